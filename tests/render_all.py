"""Render the kernel source of every known step under every option, and hash each text.

A tool, not a test (pytest does not collect it): run it under two versions of loopkern and
compare the outputs to show that a change leaves every generated kernel byte-identical::

    python tests/render_all.py --out /tmp/new.json                       # this checkout
    PYTHONPATH=/path/to/old/checkout python tests/render_all.py --out /tmp/old.json
    python tests/render_all.py --compare /tmp/old.json /tmp/new.json

An old checkout on PYTHONPATH has no ``loopkern.templates`` of its own: in a venv with an
editable install, that package (the templates) then comes from the installed checkout. The
output's meta records where loopkern and its templates came from; to render with an old
commit's own templates, install it first (``pip install --no-deps --target DIR OLD``) and
put DIR on PYTHONPATH.

The steps come from THIS directory and ../examples whatever loopkern is imported (the inputs
stay the same; only the code generator changes): every function of tests/workloads.py,
tests/refs.py and tests/bad_steps.py that validates (with the swap pairs the tests give it, and
without), the steps the examples decorate at module level (importing an example does not run
its main), and seeded random programs from tests/stepgen.py (written to a fixed folder, since
the file's path is part of the generated text; the first run saves them in a JSON file there
and later runs read that file, so that two runs compare the same programs).

Options: backend cuda (scopes grid and block, and thread for a step with no parallel
construct) and cpu (grid); debug; control; float_type None or "float32"; for CUDA by_ref None
or the indices of the scalar parameters, and for block scope staged () or the swap pairs'
parameters. Each (backend, scope) is also rendered once with cache=False. A render that raises
is recorded as "error: ..." (so a change in what is rejected shows up too).

Output: JSON {"meta": {...}, "sources": {name: sha256}} where name is
``module:function:swap=...:backend:scope:option=value...``. ``--dump DIR`` also writes each
text to DIR (file name: sha256 of the name), to diff the texts behind a changed hash.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
TEST_MODULES = ("workloads", "refs", "bad_steps")
DEFAULT_PROGDIR = "/tmp/lk-render-all-programs"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def swaps_in_tests() -> dict:
    """Step name -> the swap pairs the tests give it (``megakernel(W.step, swap=[...])``)."""
    import ast
    found: dict[str, set] = {}
    pat = re.compile(r"megakernel\(\s*(?:W|workloads|refs|B|bad_steps)\.(\w+)\s*,\s*swap=(\[[^\]]*\])")
    for path in sorted(HERE.glob("*.py")):
        for m in pat.finditer(path.read_text()):
            try:
                pairs = tuple(tuple(p) for p in ast.literal_eval(m.group(2)))
            except (ValueError, SyntaxError, TypeError):
                continue
            found.setdefault(m.group(1), set()).add(pairs)
    return found


def collect_steps(n_programs: int, n_atomic: int, seed: int, progdir: str):
    """[(module, function name, fn, swap)] for every step candidate, in a stable order."""
    sys.path.insert(0, str(HERE))
    out = []
    swaps = swaps_in_tests()
    for modname in TEST_MODULES:
        mod = importlib.import_module(modname)
        for name, fn in sorted(vars(mod).items()):
            if inspect.isfunction(fn) and fn.__module__ == mod.__name__:
                for swap in [()] + sorted(swaps.get(name, ())):
                    out.append((modname, name, fn, swap))
    import loopkern as lk
    for path in sorted(EXAMPLES.glob("*.py")):
        modname = f"lk_example_{path.stem}"
        spec = importlib.util.spec_from_file_location(modname, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[modname] = mod
        try:
            spec.loader.exec_module(mod)       # every example guards main with __name__
        except ImportError as exc:             # e.g. jax_pipeline without JAX
            print(f"skipped examples/{path.name}: {exc}", file=sys.stderr)
            continue
        for name, obj in sorted(vars(mod).items()):
            if isinstance(obj, lk.MegaKernel):
                names = obj.spec.param_names
                swap = tuple((names[a], names[b]) for a, b in obj.spec.swap)
                out.append((f"examples/{path.stem}", name, obj.fn, swap))
    out += stepgen_programs(n_programs, n_atomic, seed, progdir)
    return out


def stepgen_programs(n_programs: int, n_atomic: int, seed: int, progdir: str):
    """The random programs: generated once into ``progdir/programs-<seed>-<n>-<m>.json`` and read
    back from there by every later run (Hypothesis does not reproduce a sequence of examples
    exactly from one process to the next, so the inputs of two runs being compared are fixed on
    disk). Each program is loaded from ``progdir`` (its file name, which is in the kernel
    text, is the hash of its source)."""
    import stepgen

    os.makedirs(progdir, exist_ok=True)
    stepgen._DIR = progdir
    store = Path(progdir, f"programs-{seed}-{n_programs}-{n_atomic}.json")
    if store.exists():
        saved = json.loads(store.read_text())
    else:
        saved = _generate(n_programs, n_atomic, seed)
        tmp = store.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(saved, indent=1))
        os.replace(tmp, store)
        print(f"wrote {len(saved)} programs to {store}", file=sys.stderr)
    out = []
    for rec in saved:
        prog = stepgen.Program(source=rec["source"], kind="", dtype="", params=[], arrays={}, scalars={},
                               swap=rec["swap"], steps=0, start=0, seed=0, data_seed=0)
        out.append(("stepgen", rec["name"], stepgen.load(prog), tuple(tuple(p) for p in rec["swap"])))
    return out


def _generate(n_programs: int, n_atomic: int, seed: int) -> list:
    import stepgen
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    saved, seen = [], set()
    for atomics, count in ((False, n_programs), (True, n_atomic)):
        kept, round_ = 0, 0
        while kept < count and round_ < 50:   # Hypothesis may give fewer than max_examples
            progs = []

            @settings(max_examples=count, database=None, phases=[Phase.generate], deadline=None,
                      suppress_health_check=list(HealthCheck))
            @given(stepgen.programs(atomics=atomics))
            def collect(prog):
                progs.append(prog)

            hseed(seed * 1000 + round_)(collect)()
            round_ += 1
            for prog in progs:
                digest = _sha(prog.source)[:16]
                if digest not in seen and kept < count:
                    seen.add(digest)
                    kept += 1
                    saved.append(dict(name=f"{'atomic' if atomics else 'core'}-{digest}", source=prog.source,
                                      swap=[list(p) for p in prog.swap]))
    return saved


def variants(spec):
    """(backend, scope, options dict) for every applicable combination."""
    scalars = frozenset(i for i, p in enumerate(spec.params) if p.kind == "scalar")
    pair_params = tuple(sorted({i for pair in spec.swap for i in pair}))
    flags = [(debug, control, float_type) for debug in (False, True) for control in (True, False)
             for float_type in (None, "float32")]
    scopes = ["grid", "block"] + ([] if spec.parallel else ["thread"])
    for scope in scopes:
        for staged in [()] + ([pair_params] if scope == "block" and pair_params else []):
            for by_ref in (None, scalars):
                for debug, control, float_type in flags:
                    yield "cuda", scope, dict(debug=debug, control=control, float_type=float_type, by_ref=by_ref,
                                              staged=staged)
        yield "cuda", scope, dict(cache=False)
    for debug, control, float_type in flags:
        yield "cpu", "grid", dict(debug=debug, control=control, float_type=float_type)
    yield "cpu", "grid", dict(cache=False)


def _opt_text(opts: dict) -> str:
    parts = []
    for k in sorted(opts):
        v = opts[k]
        if isinstance(v, (frozenset, tuple)):
            v = ",".join(map(str, sorted(v))) or "-"
        elif isinstance(v, bool):
            v = int(v)
        parts.append(f"{k}={v}")
    return ":".join(parts)


def render_all(steps, dump: str | None):
    from loopkern.codegen import render_kernel
    from loopkern.validate import validate_step

    sources, skipped = {}, []
    for module, name, fn, swap in steps:
        swap_txt = "/".join(f"{a},{b}" for a, b in swap) or "-"
        base = f"{module}:{name}:swap={swap_txt}"
        try:
            spec = validate_step(fn, list(swap))
        except Exception as exc:   # StepSyntaxError for the bad steps; anything else is noted too
            skipped.append(f"{base}: {type(exc).__name__}")
            continue
        for backend, scope, opts in variants(spec):
            key = f"{base}:{backend}:{scope}:{_opt_text(opts)}"
            try:
                text = render_kernel(spec, backend, scope, fingerprint="", **opts).text
            except Exception as exc:   # recorded: what is rejected must not change either
                sources[key] = f"error: {type(exc).__name__}: {exc}"
                continue
            sources[key] = _sha(text)
            if dump:
                Path(dump, _sha(key)[:24] + ".py").write_text(f"# {key}\n{text}")
    return sources, skipped


def meta():
    import loopkern
    import loopkern.codegen as cg
    from importlib import resources
    templates = resources.files("loopkern.templates")
    return dict(loopkern=loopkern.__file__, codegen=cg.__file__, templates=str(templates),
                template_sha256={p.name: _sha(p.read_text()) for p in sorted(templates.iterdir(), key=lambda p: p.name)
                                 if p.name.endswith(".tmpl")})


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
    sa, sb = a["sources"], b["sources"]
    only_a, only_b = sorted(set(sa) - set(sb)), sorted(set(sb) - set(sa))
    changed = sorted(k for k in set(sa) & set(sb) if sa[k] != sb[k])
    print(f"{a_path}: {len(sa)} sources; {b_path}: {len(sb)} sources; {len(set(sa) & set(sb))} in both")
    for label, m in (("a", a["meta"]), ("b", b["meta"])):
        print(f"  {label}: loopkern {m['loopkern']}; templates {m['templates']}")
    if a["meta"]["template_sha256"] != b["meta"]["template_sha256"]:
        print("  templates differ:", a["meta"]["template_sha256"], b["meta"]["template_sha256"])
    errors = sum(v.startswith("error:") for v in sa.values())
    print(f"  {errors} renders raised (recorded as errors) in {a_path}")
    for title, keys in (("only in a", only_a), ("only in b", only_b), ("changed", changed)):
        print(f"{title}: {len(keys)}")
        for k in keys[:50]:
            print("   ", k, sa.get(k, "")[:80], "->", sb.get(k, "")[:80])
    return 1 if only_a or only_b or changed else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the JSON here (default: stdout)")
    p.add_argument("--programs", type=int, default=200, help="random core programs from stepgen")
    p.add_argument("--atomic-programs", type=int, default=60, help="random lk.atomic programs from stepgen")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progdir", default=DEFAULT_PROGDIR, help="where the random programs are written")
    p.add_argument("--dump", help="also write every text into this folder")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two outputs; exit 1 on a difference")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    steps = collect_steps(args.programs, args.atomic_programs, args.seed, args.progdir)
    sources, skipped = render_all(steps, args.dump)
    result = dict(meta=dict(meta(), steps=len(steps), not_valid=skipped, seed=args.seed), sources=sources)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        Path(args.out).write_text(text)
        print(f"{len(sources)} sources from {len(steps) - len(skipped)} valid steps "
              f"({len(skipped)} candidates do not validate) -> {args.out}", file=sys.stderr)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
