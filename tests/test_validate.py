"""The front end: every rule violation is reported at the right file:line:col with the source
line, a caret and a hint; all problems of a step together."""

import inspect
import re

import pytest

import loopkern as lk
import bad_steps as B

MARKS = {}
for lineno, line in enumerate(inspect.getsource(B).splitlines(), start=1):
    if "# ERR:" in line:
        MARKS[lineno] = line.split("# ERR:")[1].split("  #")[0].strip()
FILE = inspect.getsourcefile(B)
LOC = re.compile(r"^(.+?):(\d+):(\d+): in step '(\w+)':", re.M)


def expected_for(fn):
    lines, first = inspect.getsourcelines(fn)
    out = {ln: MARKS[ln] for ln in range(first, first + len(lines)) if ln in MARKS}
    # a helper's errors are reported by the step that calls it
    for helper in (B.reduction_in_helper_helper, B.recursive):
        if helper.__name__ in inspect.getsource(fn) and fn is not helper:
            hl, hf = inspect.getsourcelines(helper)
            out.update({ln: MARKS[ln] for ln in range(hf, hf + len(hl)) if ln in MARKS})
    return out


BAD = [f for name, f in inspect.getmembers(B, inspect.isfunction)
       if f.__module__ == B.__name__ and expected_for(f) and f not in (B.reduction_in_helper_helper, B.recursive)]


@pytest.mark.parametrize("fn", BAD, ids=lambda f: f.__name__)
def test_each_error_at_its_line_with_caret_and_hint(fn):
    with pytest.raises(lk.StepSyntaxError) as info:
        lk.megakernel(fn)
    err = info.value
    msg = str(err)
    want = expected_for(fn)
    got = {d.line: d for d in err.diagnostics}
    assert set(got) == set(want), msg
    for line, fragment in want.items():
        d = got[line]
        assert fragment in d.message, (fragment, d.message)
        assert d.filename == FILE and d.step == fn.__name__
        src = inspect.getsource(B).splitlines()[line - 1]
        assert d.source_line.rstrip("\n") == src
        assert 1 <= d.col <= len(src)
        text = d.format()
        first, shown, caret = text.splitlines()[:3]
        assert first.startswith(f"{FILE}:{line}:{d.col}: in step '{fn.__name__}':")
        assert shown == "    " + src
        assert caret == "    " + " " * (d.col - 1) + "^"
        assert d.hint and d.hint in text
    # the whole message lists every location
    assert {int(m.group(2)) for m in LOC.finditer(msg)} == set(want)


def test_columns_point_at_the_offending_node():
    with pytest.raises(lk.StepSyntaxError) as info:
        lk.megakernel(B.sync_in_parallel_loop)
    (d,) = info.value.diagnostics
    line = d.source_line
    assert line[d.col - 1:].startswith("lk.sync()")


def test_valid_step_with_uniform_barriers_is_accepted():
    k = lk.megakernel(B.reduction_after_loop_is_fine)
    assert k.spec.returns_condition
    assert [p.kind for p in k.spec.params] == ["array", "array"]


def test_all_problems_reported_together():
    with pytest.raises(lk.StepSyntaxError) as info:
        lk.megakernel(B.many_problems)
    assert len(info.value.diagnostics) == 5
    assert str(info.value).startswith("5 problems in the step function:")


def test_errors_are_loopkern_errors():
    assert issubclass(lk.StepSyntaxError, lk.LoopkernError)
    with pytest.raises(lk.LoopkernError):
        lk.megakernel(B.uses_list)


def test_step_needs_index_parameter():
    def no_params():
        pass
    with pytest.raises(lk.StepSyntaxError, match="step index as its first parameter"):
        lk.megakernel(no_params)


def test_signature_rules():
    def defaults(t, u, a=1.0):
        u[0] = a

    def star(t, *arrays):
        pass
    with pytest.raises(lk.StepSyntaxError, match="default parameter values"):
        lk.megakernel(defaults)
    with pytest.raises(lk.StepSyntaxError, match=r"\*args"):
        lk.megakernel(star)


@pytest.mark.parametrize("swap,fragment", [
    ([("u", "w")], "'w' is not a parameter"),
    ([("u", "u")], "two different parameters"),
    ([("u", "v"), ("v", "x")], "more than one swap pair"),
    (["uv"], "is not a pair"),
    ([("t", "u")], "'t' is not a parameter"),
])
def test_bad_swap(swap, fragment):
    def step(t, u, v, x):
        for i in lk.range(u.shape[0]):
            v[i] = u[i] + x[i]
    with pytest.raises(lk.StepSyntaxError, match=re.escape(fragment)):
        lk.megakernel(step, swap=swap)


def test_in_step_api_outside_a_step_raises():
    with pytest.raises(lk.LoopkernError, match="only be used inside a step"):
        lk.sync()
    with pytest.raises(lk.LoopkernError):
        lk.sum(1.0)


def test_step_defined_in_exec_has_clear_error():
    ns = {"lk": lk}
    exec("def step(t, u):\n    u[0] = 1.0\n", ns)
    with pytest.raises(lk.StepSyntaxError, match="cannot read the source"):
        lk.megakernel(ns["step"])


def test_globals_and_closure_numbers_are_inlined():
    factor = 3.0

    def step(t, u):
        for i in lk.range(u.shape[0]):
            u[i] = u[i] * factor + B.SCALE
    src = lk.megakernel(step).source("cpu")
    assert "* 3.0 + 2.5" in src


def test_math_and_numpy_casts_allowed():
    import math
    from math import sqrt

    def step(t, u):
        for i in lk.range(u.shape[0]):
            u[i] = np.float32(math.sin(u[i]) + sqrt(2.0) + math.pi)
    np = __import__("numpy")
    src = lk.megakernel(step).source("cuda")
    assert "_lk_math.sin" in src and "_lk_math.sqrt" in src and "_lk_np.float32" in src
