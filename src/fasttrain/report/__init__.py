"""Tables rendered from result rows only (terminal via rich, and Markdown)."""
