"""The calculator of examples/arith_tools.toml: a tool is a plain function, and
``workers.episodes:ToolEnv`` runs it when a turn of the model calls it
(``mul(123,456)``), answering with what it returns."""


def mul(a: int, b: int) -> int:
    """The product of ``a`` and ``b``."""
    return a * b
