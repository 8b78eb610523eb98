"""A helper defined in another module than the steps that call it (tests/test_inline.py)."""

K = 2.0


def scaled(x):
    return K * x
