"`tools/loader_variants.py`: every variant builds and runs on the CPU backend, and each is the pipeline its name says"
from helpers import load_tool, fmnist_path

lv = load_tool('loader_variants')


def test_each_variant_runs_and_the_table_names_them(capsys):
    res = lv.main([str(fmnist_path()), '--device', 'cpu', '--size', '32', '--bs', '8', '--batches', '1', '--warmup', '1',
                   '--passes', '1'])
    assert list(res) == list(lv.VARIANTS) and all(r > 0 for r in res.values())
    out = capsys.readouterr().out
    assert all(n in out for n in lv.VARIANTS) and '1.00x' in out  # the default row against itself
    assert 'host draws of aug_transforms(), bs 8:' in out and 'ms per batch' in out


def test_variants_compile_what_they_name():
    "One part on at a time: the recipe's rows name it, and nothing is left to fastai"
    dls = lv.variant_dls(fmnist_path(), lv.VARIANTS['warp'], 32, 8, 'cpu', val_bs=8)
    rows = dict(dls.train.recipe.describe())
    assert 'Warp' in rows and 'Rotate' not in rows and 'Brightness' not in rows and dls.train.recipe.fastai_tfms == []
    light = lv.variant_dls(fmnist_path(), lv.VARIANTS['lighting'], 32, 8, 'cpu', val_bs=8).train.recipe
    assert len(light.colour) == 1 and light.geometry == []
