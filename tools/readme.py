"""Generate README.md from the index notebook (`readme_nb` in `[tool.nbdev]`, `nbs/index.ipynb` by default).

`nbdev-readme` renders the README with Quarto, which this project's CI does not have; this converter keeps to what a
README needs and what nbdev's docs processors do:

- markdown cells verbatim, except that links to local pictures (relative to `nbs/`) are made relative to the root;
- code cells as ```python fences, their text outputs (stdout, `text/plain` results) as plain ``` fences and their
  `text/markdown` outputs verbatim; stderr, errors, images and HTML are left out;
- `#|` directive lines stripped; cells with `#| hide`, `#| export`, `#| exporti`, `#| default_exp` or
  `#| include: false` left out; `#| echo: false` shows only the outputs, `#| output: false` only the code;
- markdown headings that end with ` -` left out (nbdev's convention for "not in the docs").

    python tools/readme.py          # write README.md
    python tools/readme.py --check  # exit 1, with a diff, if README.md differs from what the notebook gives
"""
from __future__ import annotations

import argparse, difflib, json, re, sys
from pathlib import Path

try: import tomllib
except ImportError: import tomli as tomllib  # Python 3.10

ROOT = Path(__file__).resolve().parents[1]
CMD = 'python tools/readme.py'

_re_directive = re.compile(r'^\s*#\s*\|\s?(.*)$')
_re_ansi = re.compile(r'\x1B(?:[@-Z\\-_]|\[[0-?]*[ -/]*[@-~])')
_hide_dirs = {'hide', 'export', 'exporti', 'default_exp'}


def index_nb(root:Path=ROOT)->Path:
    "Path of the README's notebook, from `[tool.nbdev]` `nbs_path` and `readme_nb`"
    nbdev = tomllib.loads((Path(root)/'pyproject.toml').read_text(encoding='utf-8')).get('tool', {}).get('nbdev', {})
    return Path(root)/nbdev.get('nbs_path', 'nbs')/nbdev.get('readme_nb', 'index.ipynb')


def _text(x)->str:
    "Notebook JSON text (a string or a list of lines) as one string"
    return ''.join(x) if isinstance(x, list) else (x or '')


def split_directives(src:str)->tuple[dict, str]:
    "The leading `#|` directives of a cell source as {name: value}, and the source without them"
    lines, dirs = src.splitlines(), {}
    i = 0
    while i < len(lines):
        m = _re_directive.match(lines[i])
        if m is None: break
        words = m.group(1).strip().split(None, 1)
        if words: dirs[words[0].rstrip(':')] = words[1].strip() if len(words) > 1 else ''
        i += 1
    body = [l for l in lines[i:] if not re.search(r'#\|\s*hide_line\s*$', l)]
    return dirs, '\n'.join(body).strip('\n')


def fence(text:str, lang:str='')->str:
    "`text` in a code fence longer than any run of backticks inside it"
    ticks = '`' * max(3, 1 + max((len(r) for r in re.findall(r'`+', text)), default=0))
    return f'{ticks}{lang}\n{text.rstrip()}\n{ticks}'


def outputs_md(outputs)->list[str]:
    "Markdown blocks for a code cell's outputs: text in one plain fence, markdown verbatim"
    blocks, text = [], []
    def flush():
        if ''.join(text).strip(): blocks.append(fence(''.join(text)))
        text.clear()
    for o in outputs:
        typ = o.get('output_type')
        if typ == 'stream':
            if o.get('name') == 'stdout': text.append(_re_ansi.sub('', _text(o.get('text'))))
        elif typ in ('execute_result', 'display_data'):
            data = o.get('data', {})
            if 'text/markdown' in data:
                flush()
                blocks.append(_text(data['text/markdown']).strip())
            elif 'text/plain' in data:
                t = _re_ansi.sub('', _text(data['text/plain']))
                text.append(t if t.endswith('\n') else t + '\n')
    flush()
    return blocks


_re_local_link = re.compile(r'\]\((?!https?:|#|/)([^)\s]+\.(?:png|jpe?g|svg|gif))\)')
nbs = 'nbs'  # links in the notebook are relative to nbs/, in the README to the repository root


def cell_md(cell)->list[str]:
    "Markdown blocks for one notebook cell ([] if it is left out of the README)"
    dirs, src = split_directives(_text(cell.get('source')))
    if dirs.keys() & _hide_dirs or dirs.get('include') == 'false': return []
    typ = cell.get('cell_type')
    if typ == 'markdown':
        s = src.strip()
        if not s or (s.startswith('#') and '\n' not in s and s.endswith(' -')): return []
        return [_re_local_link.sub(lambda m: f"]({nbs}/{m.group(1)})", s)]
    if typ != 'code': return []  # raw cells hold Quarto front matter
    blocks = []
    if src.strip() and dirs.get('echo') != 'false': blocks.append(fence(src, 'python'))
    if dirs.get('output') != 'false': blocks += outputs_md(cell.get('outputs', []))
    return blocks


def readme(nb_path:Path, root:Path=ROOT)->str:
    "README.md text for the notebook at `nb_path`, of the project at `root`"
    nb_path = Path(nb_path)
    if not nb_path.exists():
        raise FileNotFoundError(f"{nb_path} not found: README.md is generated from it (`readme_nb` in pyproject.toml)")
    nb = json.loads(nb_path.read_text(encoding='utf-8'))
    blocks = [b for c in nb.get('cells', []) for b in cell_md(c)]
    try: rel = nb_path.resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError: rel = nb_path.name
    head = f'<!-- GENERATED FILE: edit {rel} instead, then run `{CMD}` -->'
    return '\n\n'.join([head, *blocks]) + '\n'


def check(root:Path=ROOT)->str:
    "'' if `root/README.md` is what the index notebook gives, else a message with a short diff"
    nb, fn = index_nb(root), Path(root)/'README.md'
    try: want = readme(nb, root)
    except FileNotFoundError as e: return str(e)
    have = fn.read_text(encoding='utf-8') if fn.exists() else ''
    if have == want: return ''
    diff = list(difflib.unified_diff(have.splitlines(), want.splitlines(), 'README.md (committed)',
                                     f'README.md (from {nb.name})', lineterm='', n=1))
    more = f'\n... {len(diff)-40} more diff lines' if len(diff) > 40 else ''
    return (f"{fn} is out of date with {nb}: run `{CMD}` and commit README.md.\n" + '\n'.join(diff[:40]) + more)


def main(argv=None)->int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--check', action='store_true', help='exit 1 if README.md differs from what the notebook gives')
    p.add_argument('--root', type=Path, default=ROOT, help='project root holding pyproject.toml (default: this repo)')
    args = p.parse_args(argv)
    if args.check:
        msg = check(args.root)
        if msg: print(msg, file=sys.stderr); return 1
        print(f"{args.root/'README.md'} is up to date")
        return 0
    try: txt = readme(index_nb(args.root), args.root)
    except FileNotFoundError as e: print(e, file=sys.stderr); return 1
    fn = args.root/'README.md'
    fn.write_text(txt, encoding='utf-8')
    print(f'wrote {fn}')
    return 0


if __name__ == '__main__': sys.exit(main())
