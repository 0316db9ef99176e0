"""Collect the rows that `fasttrain train` printed into FOLDER/run-N-*.out files: one compact
line each in FOLDER/train-WORKLOAD.jsonl, in run order, and a one-line summary per run."""
import json
import sys
from pathlib import Path


def main(folder: str) -> int:
    out = Path(folder)
    for f in sorted(out.glob("run-*.out"), key=lambda p: int(p.name.split("-")[1])):
        text = f.read_text()
        at = text.rfind('{\n "kind": "train"')  # --json, or a source before the summary
        written = [ln[5:].strip() for ln in text.splitlines() if ln.startswith("row: ")]
        if at >= 0:
            row = json.loads(text[at:])
        elif written and Path(written[-1]).is_file():  # the summary names its row file
            row = json.loads(Path(written[-1]).read_text().splitlines()[-1])
        else:
            print(f.name, "no row:", text[-300:])
            continue
        settings = [ln[5:] for ln in text.splitlines() if ln.startswith("with ")]
        if settings:  # with_attrs.py's class attributes: part of what the run measured
            row["with"] = settings
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in row["workload"])
        with open(out / f"train-{name}.jsonl", "a") as fh:  # hf:llama → train-hf_llama.jsonl
            fh.write(json.dumps(row) + "\n")
        r = row["recipe"]
        tag = f.stem.split("-", 2)[-1]  # run-N-TAG: the variant's name
        print(tag, row["workload"], r["optimizer_impl"], f"state={r.get('optimizer_state')}", r["compile_mode"],
              f"kernels={r['kernels']}", f"stream={r.get('stream_dtype')}",
              f"gemm_pad={r.get('gemm_pad')}", row.get("options") or "",
              f"{row['throughput']:.1f} {row['throughput_unit']}",
              f"{1e3 * row['step_time_s']:.2f} ms", f"warm-up {row['warmup_s']:.1f} s",
              row.get("applied", {}).get("compile"), row.get("warnings"), settings or "")
        f.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
