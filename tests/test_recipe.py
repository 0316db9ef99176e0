import pytest

from fasttrain.errors import FasttrainError
from fasttrain.recipe import Recipe, load_toml, parse_sets, to_toml


def test_defaults_are_the_fp32_baseline():
    r = Recipe()
    assert (r.precision, r.attention, r.optimizer_impl, r.workers) == ("fp32", "math", "forloop", 0)


@pytest.mark.parametrize("changes, needle", [
    ({"precision": "fp8"}, "precision='fp8'"),
    ({"attention": "fast"}, "attention="),
    ({"accumulation": 0}, "accumulation"),
    ({"batch": 10, "accumulation": 3}, "not divisible"),
    ({"cuda_graphs": True, "precision": "fp16-mixed"}, "GradScaler"),
    ({"cuda_graphs": True, "accumulation": 2, "batch": 8}, "accumulation=1"),
    ({"nonsense": 1}, "unknown switch 'nonsense'"),
    ({"workers": "many"}, "workers expects int"),
    ({"pad_multiple": -1}, "pad_multiple must be >= 0"),
    ({"kernels": "window,flash"}, "comma-separated list of patch, loss, window"),
    ({"autotune_reductions": True}, "autotune_reductions tunes torch.compile's kernels"),
    ({"pdl": True}, "pdl changes how torch.compile's kernels launch; set compile=model"),
    ({"combo_kernels": True}, "combo_kernels changes how torch.compile groups its kernels"),
    ({"graph_memset_kernels": True}, "graph_memset_kernels rewrites the captured step's CUDA "
                                     "graph; set cuda_graphs=true"),
    ({"optimizer_impl": "triton", "optimizer": "sgd"}, "it takes optimizer=adamw"),
    ({"compile_cache": True}, "compile_cache keeps torch.compile's results"),
    ({"master_weights": True, "precision": "fp16-mixed"}, "bf16-true or bf16-mixed, not fp16"),
    ({"master_weights": True, "precision": "bf16-mixed"}, "set optimizer_impl=triton"),
    ({"master_weights": True, "precision": "bf16-mixed", "optimizer_impl": "triton",
      "accumulation": 2}, "set accumulation=1"),
    ({"master_weights": True, "precision": "bf16-mixed", "optimizer_impl": "triton",
      "sharding": "zero2"}, "runs on one process, not with sharding=zero2"),
    ({"master_weights": True, "precision": "bf16-true", "optimizer_impl": "triton"},
     "master_weights only with bf16-mixed"),
    ({"master_weights": True, "precision": "bf16-true", "cuda_graphs": True},
     "(unless bf16-mixed) master_weights"),
])
def test_bad_recipes_are_one_line_errors(changes, needle):
    with pytest.raises(FasttrainError) as err:
        Recipe().replace(**changes)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_kernel_families():
    from fasttrain.recipe import KERNEL_FAMILIES, kernel_families

    assert kernel_families("none") == frozenset()
    assert kernel_families("fused") == frozenset(KERNEL_FAMILIES)
    assert kernel_families(" window, patch") == {"window", "patch"}
    assert Recipe(kernels="window,loss").kernels == "window,loss"


def test_overrides_from_strings():
    r = Recipe().replace(**parse_sets(["precision=bf16-mixed", "workers=4", "pin_memory=true",
                                       "lr=3e-4", "cuda-graphs=1"]))
    assert r.precision == "bf16-mixed" and r.workers == 4 and r.pin_memory is True
    assert r.lr == 3e-4 and r.cuda_graphs is True
    with pytest.raises(FasttrainError, match="key=value"):
        parse_sets(["precision"])


def test_toml_round_trip(tmp_path):
    r = Recipe(precision="bf16-mixed", optimizer_impl="fused", compile="regional", workers=3)
    path = tmp_path / "r.toml"
    path.write_text(to_toml(r, comment="suggested"))
    assert load_toml(path) == r


def test_toml_errors(tmp_path):
    with pytest.raises(FasttrainError, match="does not exist"):
        load_toml(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("precision = \n")
    with pytest.raises(FasttrainError, match="bad.toml"):
        load_toml(bad)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text("[recipe]\nprecision = 'int3'\n")
    with pytest.raises(FasttrainError, match="precision"):
        load_toml(wrong)


def test_describe_error_names_the_first_exception_of_a_chain():
    from fasttrain.errors import describe_error

    try:
        try:
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during capture\nmore")
        except RuntimeError:
            raise ValueError("operation failed due to a previous error during capture")
    except ValueError as err:
        line = describe_error(err)
    assert line == ("ValueError: operation failed due to a previous error during capture "
                    "(first: RuntimeError: Cannot copy between CPU and CUDA tensors during capture)")
    assert describe_error(KeyError()) == "KeyError"


def test_describe_error_respects_from_none():
    from fasttrain.errors import describe_error

    try:
        try:
            raise KeyError("batch")
        except KeyError:
            raise ValueError("bad batch") from None
    except ValueError as err:
        assert describe_error(err) == "ValueError: bad batch"


def test_bf16_mixed_master_weights_combine_with_cuda_graphs():
    r = Recipe(precision="bf16-mixed", optimizer_impl="triton", master_weights=True,
               cuda_graphs=True, compile="model")
    assert r.master_weights and r.cuda_graphs
