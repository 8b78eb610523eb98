"""2-D tile loops with literal row strides (``codegen.TILE_ROW_LITERAL``, an experiment off by
default) on the GPU: the 2-D tile-mode tests of test_tile_gpu.py run again with the literal
copy of each loop (taken where a row is at least as wide as the block), bit for bit against the
grid scope and against float64 references, at several block counts and odd shapes."""

import pytest

from loopkern import codegen

from .test_tile_gpu import (test_a_one_sided_wrapping_stencil_in_tile_mode,  # noqa: F401
                            test_game_of_life_in_tile_mode_equals_the_grid_scope,
                            test_jacobi_whose_exchange_passes_its_reductions_barrier,
                            test_two_dimensional_heat_in_tile_mode_equals_the_grid_scope,
                            test_two_swap_pairs_exchanged_between_two_dimensional_tiles, switch_on)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def row_literal(monkeypatch):
    check = switch_on(monkeypatch, codegen, "TILE_ROW_LITERAL", "_rows == 1:")
    yield
    check()
