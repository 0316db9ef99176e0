"""``fasttrain fit``: the largest batch that really fits (search), each trial a fresh process
running the whole job at that batch (trial)."""
