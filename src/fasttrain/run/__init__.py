"""The timed training loop, its phase timers, CUDA graph capture and the parity gate."""
