"""Tables rendered from result rows only (terminal via rich, Markdown for the README)."""
