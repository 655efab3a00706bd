"""The tool of the SmolLM2 tool example (``tools.toml``)."""


def multiply(a: int, b: int) -> int:
    """The product of two integers."""
    return int(a) * int(b)
