"""Generate `settings.ini`, the nbdev-2 view of the settings in `pyproject.toml`.

nbdev 3 reads only `pyproject.toml`; `settings.ini` is kept for nbdev-2-era tools (and readers) that look for it.
It is generated, never edited by hand:

    python tools/settings_ini.py          # write settings.ini
    python tools/settings_ini.py --check  # exit 1, naming the drifted keys, if settings.ini is out of date

Values are derived with `tomllib` from `pyproject.toml` the way nbdev 3's `get_config` derives them (the tests check
that the two agree), and `version` is read from `<lib_path>/__init__.py`.
"""
from __future__ import annotations

import argparse, configparser, re, sys
from pathlib import Path

try: import tomllib
except ImportError: import tomli as tomllib  # Python 3.10

ROOT = Path(__file__).resolve().parents[1]
CMD = 'python tools/settings_ini.py'

# nbdev 3's defaults for `[tool.nbdev]` keys (`nbdev.config.nbdev_defaults`), plus the nbdev-2 keys nbdev 3 dropped
NBDEV_DEFAULTS = dict(nbs_path='nbs', doc_path='_docs', tst_flags='notest', recursive=True, readme_nb='index.ipynb',
    clean_ids=True, clear_all=False, put_version_in_init=True, jupyter_hooks=False, custom_sidebar=False, branch='main',
    update_pyproject=True, black_formatting=False, allowed_metadata_keys='', allowed_cell_metadata_keys='',
    cell_number=True, skip_procs='')

# SPDX identifier -> nbdev-2 license key (inverse of `nbdev.migrate._license_map`)
LICENSES = {'Apache-2.0': 'apache2', 'MIT': 'mit', 'GPL-2.0': 'gpl2', 'GPL-3.0': 'gpl3', 'BSD-3-Clause': 'bsd3'}
# PyPI "Development Status" classifier -> nbdev-2 `status`
STATUSES = {'Planning': '1', 'Pre-Alpha': '2', 'Alpha': '3', 'Beta': '4', 'Production/Stable': '5', 'Mature': '6',
            'Inactive': '7'}

# The sections and key order of nbdev 2's `nbdev_create_config`, plus the keys its later versions appended
SECTIONS = {
    'Python library': 'repo lib_name version min_python license black_formatting',
    'nbdev': 'doc_path lib_path nbs_path recursive tst_flags put_version_in_init update_pyproject',
    'Docs': 'branch custom_sidebar doc_host doc_baseurl git_url title',
    'PyPI': 'audience author author_email copyright description keywords language status user',
    'Requirements': 'requirements dev_requirements console_scripts',
    'Notebooks': 'readme_nb jupyter_hooks clean_ids clear_all allowed_metadata_keys allowed_cell_metadata_keys '
                 'cell_number skip_procs',
}

_re_version = re.compile(r'^__version__\s*=\s*[\'"]([^\'"]+)[\'"]', re.MULTILINE)
_re_repo = re.compile(r'^(?:https?://|git@)[^/:]+[/:]([^/]+)/([^/]+?)(?:\.git)?/?$')


def read_version(lib_path:Path)->str:
    "`__version__` from `lib_path/__init__.py`"
    init = lib_path/'__init__.py'
    m = _re_version.search(init.read_text(encoding='utf-8')) if init.exists() else None
    if m is None: raise ValueError(f"no `__version__ = \"...\"` line in {init}: settings.ini takes its version from it")
    return m.group(1)


def _classifier(classifiers, prefix, default=''):
    "Value of the first `prefix :: value` classifier, or `default`"
    vals = [c.split('::', 1)[1].strip() for c in classifiers if c.split('::', 1)[0].strip() == prefix]
    return vals[0] if vals else default


def _req(spec:str)->str:
    "A requirement spec with its whitespace removed: nbdev 2 splits requirement lists on whitespace"
    return ''.join(spec.split())


def _fmt(v)->str:
    "A value as nbdev 2 wrote it in settings.ini"
    if isinstance(v, bool): return str(v)
    if isinstance(v, (list, tuple)): return ' '.join(map(str, v))
    return str(v)


def settings(root:Path=ROOT)->dict:
    "The settings.ini `[DEFAULT]` values for the project at `root`, as strings, in nbdev 2's key order"
    root = Path(root)
    toml = tomllib.loads((root/'pyproject.toml').read_text(encoding='utf-8'))
    proj, nbdev = toml.get('project', {}), toml.get('tool', {}).get('nbdev')
    if nbdev is None: raise ValueError(f"{root/'pyproject.toml'} has no [tool.nbdev] section: it is not an nbdev 3 project")
    cfg = {**NBDEV_DEFAULTS, **nbdev}
    lib_name = proj.get('name', '')
    lib_path = cfg.get('lib_path') or lib_name.replace('-', '_')

    urls = proj.get('urls', {})
    git_url = (urls.get('Repository') or urls.get('Source') or '').rstrip('/')
    m = _re_repo.match(git_url)
    if git_url and not m: raise ValueError(f"cannot read user/repo from [project.urls] Repository = {git_url!r}")
    user, repo = m.groups() if m else ('', lib_name)
    doc_url = urls.get('Documentation', '')
    dm = re.match(r'^(\w+://[^/]+)(/.*)?$', doc_url)
    doc_host, doc_baseurl = (dm.group(1), (dm.group(2) or '/').rstrip('/') or '/') if dm else ('', '/')

    req_py = proj.get('requires-python', '>=3.9')
    if not re.fullmatch(r'>=\s*[\d.]+', req_py.strip()):
        raise ValueError(f"requires-python = {req_py!r}: settings.ini needs a plain '>=X.Y' to give min_python")
    lic = proj.get('license', '')
    if isinstance(lic, dict): lic = lic.get('text', '')
    authors = proj.get('authors') or [{}]
    author = authors[0].get('name', '')
    classifiers = proj.get('classifiers', [])
    dev_status = _classifier(classifiers, 'Development Status')
    scripts = [f'{k}={v}' for k,v in proj.get('scripts', {}).items()]

    vals = dict(
        repo=repo, lib_name=lib_name, version=read_version(root/lib_path),
        min_python=req_py.strip().lstrip('>=').strip(), license=LICENSES.get(lic, lic),
        black_formatting=cfg['black_formatting'],
        doc_path=cfg['doc_path'], lib_path=lib_path, nbs_path=cfg['nbs_path'], recursive=cfg['recursive'],
        tst_flags=cfg['tst_flags'], put_version_in_init=cfg['put_version_in_init'],
        update_pyproject=cfg['update_pyproject'],
        branch=cfg['branch'], custom_sidebar=cfg['custom_sidebar'], doc_host=doc_host, doc_baseurl=doc_baseurl,
        git_url=git_url, title=cfg.get('title') or lib_name,
        audience=_classifier(classifiers, 'Intended Audience', 'Developers'), author=author,
        author_email=authors[0].get('email', ''), copyright=cfg.get('copyright') or author,
        description=proj.get('description', ''), keywords=proj.get('keywords', []),
        language=_classifier(classifiers, 'Natural Language', 'English'),
        status=STATUSES.get(dev_status.split(' - ')[-1].strip(), '3') if dev_status else '3', user=user,
        requirements=[_req(o) for o in proj.get('dependencies', [])],
        dev_requirements=[_req(o) for o in proj.get('optional-dependencies', {}).get('dev', [])],
        # nbdev 2 reads one `name=module:func` per line, continuation lines indented
        console_scripts='\n    '.join(scripts),
        readme_nb=cfg['readme_nb'], jupyter_hooks=cfg['jupyter_hooks'], clean_ids=cfg['clean_ids'],
        clear_all=cfg['clear_all'], allowed_metadata_keys=cfg['allowed_metadata_keys'],
        allowed_cell_metadata_keys=cfg['allowed_cell_metadata_keys'], cell_number=cfg['cell_number'],
        skip_procs=cfg['skip_procs'],
    )
    keys = ' '.join(SECTIONS.values()).split()
    assert set(keys) == set(vals), f'SECTIONS and settings() disagree on: {set(keys) ^ set(vals)}'
    return {k: _fmt(vals[k]) for k in keys}


def render(root:Path=ROOT)->str:
    "The text of settings.ini for the project at `root`"
    vals = settings(root)
    out = ['# GENERATED FILE: do not edit. Made from pyproject.toml (and the version in the package __init__.py)',
           f'# by `{CMD}`; `{CMD} --check` (run by tests/test_settings.py) fails when it drifts.',
           '# nbdev 3 reads only pyproject.toml: change settings there, then regenerate this file.',
           '', '[DEFAULT]']
    for title, keys in SECTIONS.items():
        out.append(f'### {title} ###')
        # `%` starts an interpolation for configparser, which is how nbdev 2 read this file
        out += [f'{k} = {vals[k]}'.replace('%', '%%').rstrip() for k in keys.split()]
        out.append('')
    return '\n'.join(out)


def parse(text:str)->dict:
    "The `[DEFAULT]` values of a settings.ini text, read as nbdev 2 read them (with configparser)"
    cp = configparser.ConfigParser()
    cp.read_string(text)
    return {k: cp['DEFAULT'][k] for k in cp.defaults()}


def drift(root:Path=ROOT)->list[str]:
    "Keys whose value in `root/settings.ini` differs from `pyproject.toml`'s, or `['<formatting>']`; [] if up to date"
    fn = Path(root)/'settings.ini'
    if not fn.exists(): return ['<missing settings.ini>']
    cur, want = fn.read_text(encoding='utf-8'), render(root)
    if cur == want: return []
    try: have = parse(cur)
    except configparser.Error as e: return [f'<unparsable: {e}>']
    exp = parse(want)
    keys = [k for k in exp if have.get(k) != exp[k]] + sorted(k for k in have if k not in exp)
    return keys or ['<formatting>']


def check(root:Path=ROOT)->str:
    "'' if `root/settings.ini` is up to date, else a message naming the drifted keys and how to fix them"
    keys = drift(root)
    if not keys: return ''
    return (f"{Path(root)/'settings.ini'} is out of date with pyproject.toml; drifted: {', '.join(keys)}. "
            f"Run `{CMD}` and commit settings.ini.")


def main(argv=None)->int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--check', action='store_true', help='exit 1 if settings.ini differs from what pyproject.toml gives')
    p.add_argument('--root', type=Path, default=ROOT, help='project root holding pyproject.toml (default: this repo)')
    args = p.parse_args(argv)
    if args.check:
        msg = check(args.root)
        if msg: print(msg, file=sys.stderr); return 1
        print(f"{args.root/'settings.ini'} is up to date")
        return 0
    fn = args.root/'settings.ini'
    fn.write_text(render(args.root), encoding='utf-8')
    print(f'wrote {fn}')
    return 0


if __name__ == '__main__': sys.exit(main())
