"""Research and test helpers: the in-process simulator and the tiny debug model."""
