"settings.ini is generated from pyproject.toml: it must not drift, the drift check must be able to fail, and nbdev agrees"
import re, shutil, subprocess, sys
from pathlib import Path

import pytest

from helpers import load_tool

ROOT = Path(__file__).resolve().parents[1]
si = load_tool('settings_ini')
LIB = si.settings(ROOT)['lib_path']


def test_settings_ini_is_up_to_date():
    msg = si.check(ROOT)
    assert not msg, msg


@pytest.fixture
def proj(tmp_path):
    "A throwaway copy of the files settings.ini is made from, and settings.ini itself"
    for f in ('pyproject.toml', 'settings.ini'): shutil.copy(ROOT/f, tmp_path/f)
    (tmp_path/LIB).mkdir()
    shutil.copy(ROOT/LIB/'__init__.py', tmp_path/LIB/'__init__.py')
    return tmp_path


def _sub(path, pat, repl):
    "Replace the one match of `pat` in the file at `path`"
    txt, n = re.subn(pat, repl, path.read_text(), count=1, flags=re.MULTILINE)
    assert n == 1, f'{pat!r} not found in {path}'
    path.write_text(txt)


def test_copy_starts_clean(proj): assert si.drift(proj) == []


def test_pyproject_change_is_drift(proj):
    _sub(proj/'pyproject.toml', r'^description = ".*"$', 'description = "something else"')
    assert si.drift(proj) == ['description']
    assert 'description' in si.check(proj) and si.CMD in si.check(proj)


def test_nbdev_setting_change_is_drift(proj):
    _sub(proj/'pyproject.toml', r'^tst_flags = ".*"$', 'tst_flags = "notest cuda slow"')
    assert si.drift(proj) == ['tst_flags']


def test_version_change_is_drift(proj):
    _sub(proj/LIB/'__init__.py', r'^__version__ = .*$', '__version__ = "9.9.9"')
    assert si.drift(proj) == ['version']


def test_hand_edits_are_drift(proj):
    ini = proj/'settings.ini'
    _sub(ini, r'^branch = .*$', 'branch = master')
    ini.write_text(ini.read_text() + 'host = github\n')
    assert si.drift(proj) == ['branch', 'host']
    shutil.copy(ROOT/'settings.ini', ini)
    ini.write_text(ini.read_text().replace('### Docs ###', '### Documentation ###'))
    assert si.drift(proj) == ['<formatting>']
    ini.unlink()
    assert si.drift(proj) == ['<missing settings.ini>']


def test_cli(proj):
    def run(*args): return subprocess.run([sys.executable, ROOT/'tools'/'settings_ini.py', '--root', proj, *args],
                                          capture_output=True, text=True)
    assert run('--check').returncode == 0
    _sub(proj/'pyproject.toml', r'^requires-python = ".*"$', 'requires-python = ">=3.12"')
    r = run('--check')
    assert r.returncode == 1 and 'min_python' in r.stderr, r
    assert run().returncode == 0
    assert run('--check').returncode == 0
    assert 'min_python = 3.12\n' in (proj/'settings.ini').read_text()


def test_bad_pyproject_is_explained(proj):
    _sub(proj/'pyproject.toml', r'^requires-python = ".*"$', 'requires-python = ">=3.10,<4"')
    with pytest.raises(ValueError, match="plain '>=X.Y'"): si.settings(proj)
    _sub(proj/'pyproject.toml', r'^\[tool\.nbdev\]$', '[tool.not_nbdev]')
    with pytest.raises(ValueError, match=r'no \[tool.nbdev\]'): si.settings(proj)


def test_header_names_the_command():
    head = (ROOT/'settings.ini').read_text().split('[DEFAULT]')[0]
    assert 'GENERATED' in head and si.CMD in head


def test_agrees_with_nbdev_get_config():
    "Every key nbdev 3 also derives has the value nbdev 3's own `get_config` gives it"
    from nbdev.config import get_config
    cfg, ini = get_config(ROOT), si.parse((ROOT/'settings.ini').read_text())
    def val(k):
        v = cfg[k] if k in cfg.d else getattr(cfg, k)
        if k in ('lib_path', 'nbs_path', 'doc_path'): v = Path(v).relative_to(cfg.config_path).as_posix()
        return si._fmt(v)
    keys = ('lib_name repo user version min_python doc_path lib_path nbs_path recursive tst_flags put_version_in_init '
            'branch custom_sidebar doc_host doc_baseurl git_url title author author_email description keywords '
            'readme_nb jupyter_hooks clean_ids clear_all').split()
    assert {k: ini[k] for k in keys} == {k: val(k) for k in keys}


def test_nbdev_migrates_it_back(tmp_path):
    "nbdev's settings.ini -> pyproject.toml migration, run on our settings.ini, gives back our [project] values"
    from fastcore.xtras import Config
    from nbdev import migrate
    try: import tomllib
    except ImportError: import tomli as tomllib
    d = Config(ROOT, 'settings.ini').d
    back = tomllib.loads(migrate._nbdev_migrate_config(d, tmp_path))
    ours = tomllib.loads((ROOT/'pyproject.toml').read_text())
    p, q = back['project'], ours['project']
    norm = lambda reqs: [''.join(r.split()) for r in reqs]
    for k in ('name', 'description', 'requires-python', 'license', 'authors', 'keywords', 'scripts'):
        assert p.get(k) == q.get(k), k
    assert norm(p['dependencies']) == norm(q['dependencies'])
    assert norm(p['optional-dependencies']['dev']) == norm(q['optional-dependencies']['dev'])
    assert p['urls']['Repository'] == q['urls']['Repository']
    assert p['urls']['Documentation'].rstrip('/') == q['urls']['Documentation'].rstrip('/')
    assert back['tool']['nbdev'].items() <= ours['tool']['nbdev'].items()
