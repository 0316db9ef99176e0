"""The speed-up ladder: cumulative recipes, one fresh process per rung, parity against fp32."""
