"""litft find-batch-size: the search, and the command on the CPU (where every size fits up to --max)."""

import pytest

from litft.batch_size import search


@pytest.mark.parametrize("limit, start, maximum", [(37, 8, 256), (37, 64, 256), (1, 16, 256), (256, 4, 256),
                                                   (100, 1, 64), (5, 5, 256)])
def test_the_search_finds_the_largest_size_that_fits_in_few_trials(limit, start, maximum):
    tried = []

    def fits(size):
        tried.append(size)
        return size <= limit

    assert search(fits, start, maximum) == min(limit, maximum)
    assert len(tried) <= 2 * maximum.bit_length() and len(set(tried)) == len(tried)  # no size twice


def test_nothing_fits():
    assert search(lambda size: False, 8, 256) is None


def test_the_command_runs_trials_and_writes_the_recipe_copy(tmp_path, capsys):
    from litft.cli import main
    from litft.recipe import load_recipe

    copy = tmp_path / "demo-bs.yaml"
    assert main(["find-batch-size", "--config", "demo", "--max", "4", "--steps", "1", "--write", str(copy),
                 "--data.num_workers", "0", "--logging.tensorboard", "false"]) == 0
    out = capsys.readouterr().out
    assert "micro batch 1: fits" in out and "micro batch 4: fits" in out
    assert "largest micro batch that fits: 4" in out
    recipe = load_recipe(copy)
    assert recipe.train.micro_batch_size == 4 and recipe.train.global_batch_size % 4 == 0
