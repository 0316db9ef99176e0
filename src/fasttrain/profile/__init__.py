"""``fasttrain profile``: where a step's time and memory go, and what to switch on next."""
