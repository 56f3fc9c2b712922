"""The collector settings of the processes the project starts (passes.ir.heap)."""
import gc

from passes.ir.heap import YOUNG_THRESHOLD, collect_young_less_often


def test_the_young_threshold_is_raised_never_lowered_and_the_older_ones_kept():
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 7, 9)
        collect_young_less_often()
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 7, 9)
        gc.set_threshold(5 * YOUNG_THRESHOLD, 7, 9)
        collect_young_less_often()
        assert gc.get_threshold() == (5 * YOUNG_THRESHOLD, 7, 9)
        gc.set_threshold(0, 7, 9)  # the collector switched off by threshold: left off
        collect_young_less_often()
        assert gc.get_threshold() == (0, 7, 9)
    finally:
        gc.set_threshold(*saved)
