"""`tools/mutants.py` (`make mutants`) stays usable: every planted mutant still names one place in the package, and a
row whose text has moved stops the tool with a message that says which."""
from pathlib import Path

import pytest

from helpers import load_tool

mutants = load_tool('mutants')
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize('i', range(1, len(mutants.MUTANTS) + 1))
def test_every_mutant_applies(i):
    "After a refactoring, update the row (`tools/mutants.py`) whose original text moved"
    f = mutants.check_applies(i, mutants.MUTANTS[i - 1])
    assert mutants.MUTANTS[i - 1][1] != mutants.MUTANTS[i - 1][2], "a mutant changes something"
    assert f.is_file()


def test_a_stale_row_fails_loudly():
    with pytest.raises(SystemExit, match="mutant 99 no longer applies: dali_fastai/loader.py has no 'no such text'"):
        mutants.check_applies(99, ('loader', 'no such text', 'x', 'nothing'))
    with pytest.raises(SystemExit, match="mutant 98 no longer applies: dali_fastai/pipeline.py has [0-9]+ copies of 'def '"):
        mutants.check_applies(98, ('pipeline', 'def ', 'x', 'names many places'))


def test_selections_name_existing_tests():
    for module,args in mutants.SELECTIONS.items():
        assert (ROOT/'dali_fastai'/f'{module}.py').is_file()
        for a in args:
            if not a.startswith('-'): assert (ROOT/a.split('::')[0]).is_file(), a
    assert {m[0] for m in mutants.MUTANTS} <= set(mutants.SELECTIONS)
