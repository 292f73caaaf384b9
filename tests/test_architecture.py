"""The package's layers (`nbs/00_architecture.ipynb`): a module imports only modules whose notebooks sort before its own,
and the notebooks sort in the order of the layers `LAYERS` names; no import cycle."""
from pathlib import Path
import pytest

from dali_fastai.architecture import LAYERS, import_graph, notebook_of, rightward, cycles, layer_number

ROOT = Path(__file__).resolve().parents[1]
GRAPH = import_graph(ROOT/'dali_fastai', ROOT/'nbs')


def test_no_import_cycle():
    assert cycles(GRAPH) == [], f"modules that import one another: {cycles(GRAPH)}"


def test_every_module_in_one_layer():
    named = [m for _,ms,_ in LAYERS for m in ms]
    assert sorted(named) == sorted(set(named)) and set(named) == set(GRAPH), set(named) ^ set(GRAPH)


def test_imports_point_left():
    assert rightward(GRAPH) == [], f"imports of a module whose notebook sorts after the importer's: {rightward(GRAPH)}"


def test_notebooks_sort_by_layer():
    "In the notebooks' order the layers come as `LAYERS` names them, and no two layers share a number"
    layer = {m: i for i,(_,ms,_) in enumerate(LAYERS) for m in ms}
    nbs = notebook_of(ROOT/'nbs')
    order = [layer[m] for m in GRAPH]
    assert order == sorted(order), [(m, nbs.get(m), LAYERS[layer[m]][0]) for m in GRAPH]
    numbers = {}
    for m in GRAPH: numbers.setdefault(layer_number(nbs.get(m, '')), set()).add(LAYERS[layer[m]][0])
    assert all(len(v) == 1 for v in numbers.values()), numbers
