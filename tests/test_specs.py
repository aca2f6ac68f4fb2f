"""The spec resolver: models, datasets and losses by zoo name, module path or file, and its errors.

Every spec a user can write either resolves or fails with one ``SpecError`` line that quotes
the spec and says what was expected; the fuzz test at the end feeds the three resolvers
over 1,000 generated specs (odd module names, missing files, files that fail to import or
exit, builders that raise, bad keyword arguments) and allows nothing else.
"""

from __future__ import annotations

import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

import click
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from shared.cli import parse_kv
from shared.errors import SpecError, UserError
from shared.resolve import cross_entropy, mse, resolve_dataset, resolve_loss, resolve_model

USER_CODE = {
    "ok.py": """
        import torch
        from torch import nn

        def build(width=4, classes=2):
            return nn.Sequential(nn.Linear(width, classes))

        def data(size=3):
            return [(torch.zeros(4), i % 2) for i in range(size)]

        def loss(output, target):
            return output.sum() * 0

        class Loss:
            def __call__(self, output, target):
                return output.sum() * 0
        """,
    "broken.py": "def build(:\n    pass\n",
    "raises.py": "raise RuntimeError('boom on import\\nsecond line')\n",
    "exits.py": "import sys\nsys.exit(3)\n",
    "funcs.py": """
        x = 5

        def raises(**kwargs):
            raise RuntimeError("a builder that fails\\nover two lines")

        def returns_int():
            return 3

        def needs(a, b):
            return None

        class BadLoss:
            def __init__(self):
                raise ValueError("no loss for you")

        class _NegativeLen:
            def __getitem__(self, i):
                return (i, i)

            def __len__(self):
                return -1

        def negative_len():
            return _NegativeLen()

        def empty():
            return []
        """,
    "notes.txt": "not python at all\n",
}


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("user_code")
    for name, text in USER_CODE.items():
        (root / name).write_text(textwrap.dedent(text))
    (root / "a_directory.py").mkdir()
    return root


def one_line_spec_error(exc: BaseException, spec: str) -> str:
    assert isinstance(exc, SpecError), f"{type(exc).__name__}: {exc}"
    text = str(exc)
    assert "\n" not in text and "\r" not in text, repr(text)
    assert repr(spec) in text, f"does not quote the spec {spec!r}: {text!r}"
    return text


# --- what resolves --------------------------------------------------------------------------


def test_zoo_model_with_keyword_arguments() -> None:
    model = resolve_model("zoo:resmlp", {"width": 8, "depth": 1})
    assert isinstance(model, nn.Module)
    assert model(torch.zeros(2, 64)).shape == (2, 10)
    assert sum(p.numel() for p in model.parameters()) == 64 * 8 + 8 + 2 * (8 * 8 + 8) + 8 * 10 + 10


def test_module_callable_spec() -> None:
    model = resolve_model("torch.nn:Linear", {"in_features": 3, "out_features": 2})
    assert isinstance(model, nn.Linear) and model.weight.shape == (2, 3)


def test_file_specs_for_model_dataset_and_loss(user_dir: Path) -> None:
    model = resolve_model(f"{user_dir}/ok.py:build", {"width": 4})
    assert model(torch.zeros(1, 4)).shape == (1, 2)
    data = resolve_dataset(f"{user_dir}/ok.py:data", {"size": 5})
    assert len(data) == 5 and data[3][1] == 1
    assert resolve_loss(f"{user_dir}/ok.py:loss")(torch.ones(2), None).item() == 0
    # A class is a factory: its instance is the loss.
    assert resolve_loss(f"{user_dir}/ok.py:Loss")(torch.ones(2), None).item() == 0


def test_builtin_losses() -> None:
    assert resolve_loss("cross_entropy") is cross_entropy and resolve_loss("mse") is mse
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1]))
    assert torch.allclose(cross_entropy(logits, torch.tensor([0, 1])), expected)
    # An auxiliary head (Inception's) adds 0.4 of its own loss.
    assert torch.allclose(cross_entropy((logits, logits), torch.tensor([0, 1])), 1.4 * expected)
    # Any other second output ((logits, features), as a new user's model returned) is not the loss's: it
    # was scored as class logits once, silently.
    features = torch.randn(2, 32, dtype=torch.float64)
    logits64 = logits.double()
    assert (
        cross_entropy((logits64, features), torch.tensor([0, 1])).item()
        == cross_entropy(logits64, torch.tensor([0, 1])).item()
    )
    assert isinstance(resolve_loss("torch.nn:MSELoss"), nn.MSELoss)


def test_zoo_dataset() -> None:
    data = resolve_dataset("zoo:synthetic", {"size": 4, "shape": [3]})
    assert len(data) == 4 and data[0][0].shape == (3,)


# --- what does not, and how it says so ------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "spec", "args", "expected"),
    [
        ("model", "zoo:resmpl", {}, "no such zoo model (known: "),
        ("model", "zoo:resmlp", {"widht": 3}, "unexpected keyword argument 'widht'"),
        ("model", "zoo:resmlp", {"width": -1}, "RuntimeError"),
        ("model", "zoo:bad name\n", {}, "expected zoo:NAME"),
        ("model", "..:x", {}, "cannot import module '..'"),
        ("model", "no_such_module_xyz:build", {}, "cannot import module 'no_such_module_xyz'"),
        ("model", "math:pi", {}, "math.pi is not callable"),
        ("model", "math:nope", {}, "math has no attribute 'nope'"),
        ("model", "collections:OrderedDict", {}, "returned OrderedDict, expected a torch.nn.Module"),
        ("model", "build", {}, "expected zoo:NAME, package.module:callable or path/to/file.py:callable"),
        ("dataset", "zoo:synthetic", {"size": -1}, "with {'size': -1}: ValueError: size must be at least 1"),
        ("dataset", "math:sqrt", {}, "missing a required argument"),
        ("loss", "hinge", {}, "expected cross_entropy, causal_lm, mse or a callable spec"),
        ("loss", "torch.nn:Linear", {}, "Linear() failed: TypeError"),
        ("loss", "collections:OrderedDict", {}, "OrderedDict() gave OrderedDict, expected a callable loss"),
    ],
)
def test_bad_specs_are_one_line(kind: str, spec: str, args: dict[str, Any], expected: str) -> None:
    with pytest.raises(SpecError) as info:
        _resolve(kind, spec, args)
    assert expected in one_line_spec_error(info.value, spec)


@pytest.mark.parametrize(
    ("kind", "target", "expected"),
    [
        ("model", "missing.py:build", "file '{dir}/missing.py' not found"),
        ("model", "broken.py:build", "importing '{dir}/broken.py' failed: SyntaxError"),
        ("model", "raises.py:build", "failed: RuntimeError: boom on import second line"),
        ("model", "exits.py:build", "failed: SystemExit: 3"),
        ("model", "notes.txt:build", "cannot load '{dir}/notes.txt' as Python"),
        ("model", "a_directory.py:build", "not found"),
        ("model", "funcs.py:x", "is not callable"),
        ("model", "funcs.py:raises", "RuntimeError: a builder that fails over two lines"),
        ("model", "funcs.py:returns_int", "returned int, expected a torch.nn.Module"),
        ("model", "funcs.py:needs", "missing a required argument: 'a' (accepted arguments: a, b)"),
        ("dataset", "funcs.py:negative_len", "len() of the dataset failed"),
        ("dataset", "funcs.py:empty", "the dataset is empty"),
        ("dataset", "funcs.py:returns_int", "returned int, expected a map-style Dataset"),
        ("loss", "funcs.py:BadLoss", "BadLoss() failed: ValueError: no loss for you"),
    ],
)
def test_bad_user_files_are_one_line(user_dir: Path, kind: str, target: str, expected: str) -> None:
    spec = f"{user_dir}/{target}"
    with pytest.raises(SpecError) as info:
        _resolve(kind, spec, {})
    assert expected.format(dir=user_dir) in one_line_spec_error(info.value, spec)


def _resolve(kind: str, spec: str, args: dict[str, Any]) -> object:
    if kind == "model":
        return resolve_model(spec, args)
    if kind == "dataset":
        return resolve_dataset(spec, args)
    return resolve_loss(spec)


# --- fuzz: 1,000 specs, each resolves or fails with one SpecError line ----------------------

# Module targets are drawn from a fixed list plus names that cannot exist ("zz..."):
# importing an arbitrary real module can have effects (`this` prints, `antigravity` opens a
# browser), and attributes from a list of harmless ones.
ODD_TARGETS = ["", ".", "..", "..x", ".x", "x.", "a..b", "a b", "1abc", "\u00e9t\u00e9", "\x00", "os", "math",
               "json", "collections", "torch.nn", "shared", "shared.zoo.registry", "shared.resolve"]  # fmt: skip
ATTRS = ["", "nope", "pi", "sqrt", "dumps", "Linear", "Module", "ReLU", "OrderedDict", "__name__", "__doc__",
         "path", "MODELS", "model_builder", "models", "build", "data", "loss", "Loss", "x", "raises",
         "returns_int", "needs", "BadLoss", "negative_len", "empty", "resolve_loss"]  # fmt: skip
FILES = [*USER_CODE, "missing.py", "a_directory.py", "sub/none.py"]
ZOO = ["resmlp", "mnist_cnn", "resmpl", "RESMLP", "synthetic", "zz", "", "a b", "x\ny", "../resmlp"]
ARG_KEYS = ["width", "depth", "in_features", "out_features", "classes", "channels", "size", "shape",
            "num_classes", "split", "seed", "bogus"]  # fmt: skip
ARG_VALUES: st.SearchStrategy[Any] = st.integers(-3, 8) | st.sampled_from(
    ["x", "val", None, [2], [-1], 1.5, True, {}]
)


@st.composite
def specs(draw: st.DrawFn, user_dir: Path) -> tuple[str, str, dict[str, Any]]:
    kind = draw(st.sampled_from(["model", "dataset", "loss"]))
    form = draw(st.sampled_from(["zoo", "module", "file", "builtin", "text"]))
    attr = draw(st.sampled_from(ATTRS) | st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True))
    if form == "zoo":
        spec = "zoo:" + draw(st.sampled_from(ZOO) | st.text(max_size=8))
    elif form == "module":
        target = draw(
            st.sampled_from(ODD_TARGETS)
            | st.from_regex(r"[a-z_.]{0,10}", fullmatch=True).map(lambda t: "zz" + t)
        )
        spec = f"{target}:{attr}"
    elif form == "file":
        spec = f"{user_dir}/{draw(st.sampled_from(FILES))}:{attr}"
    elif form == "builtin":
        spec = draw(st.sampled_from(["cross_entropy", "mse", "Cross_Entropy", "l1", ":", "::", ":x", "x:"]))
    else:
        # Free text, made unimportable (a leading digit), so no real module is ever imported.
        spec = "9" + draw(st.text(max_size=20))
    args = draw(st.dictionaries(st.sampled_from(ARG_KEYS), ARG_VALUES, max_size=3))
    return kind, spec, args


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # Linear(0, n) from fuzzed widths
def test_spec_resolver_fuzz(user_dir: Path) -> None:
    seen: Counter[str] = Counter()

    @settings(max_examples=1000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=specs(user_dir))
    def check(case: tuple[str, str, dict[str, Any]]) -> None:
        kind, spec, args = case
        try:
            _resolve(kind, spec, args)
        except UserError as exc:
            one_line_spec_error(exc, spec)
            seen["error"] += 1
        else:
            seen["ok"] += 1

    check()
    assert sum(seen.values()) >= 1000
    assert seen["error"] >= 700 and seen["ok"] >= 10, dict(seen)


# --- keyword arguments on the command line (--model-arg K=V) --------------------------------


def test_keyword_arguments_are_python_literals_or_text() -> None:
    got = parse_kv(
        ["width=64", "shape=(3, 224, 224)", "name=resnet", "ratio=0.5", "flag=True"], "--model-arg"
    )
    assert got == {"width": 64, "shape": (3, 224, 224), "name": "resnet", "ratio": 0.5, "flag": True}
    # Too deep or too long to read as a literal: kept as text, never a crash.
    assert parse_kv(["x=" + "[" * 100_000], "--model-arg")["x"].startswith("[[[")
    assert parse_kv(["x=" + "9" * 5000], "--model-arg")["x"] == "9" * 5000


@settings(max_examples=300, deadline=None, database=None)
@given(pairs=st.lists(st.text(max_size=30), max_size=4))
def test_keyword_argument_fuzz(pairs: list[str]) -> None:
    try:
        parsed = parse_kv(pairs, "--model-arg")
    except click.BadParameter as exc:
        assert "expected key=value with a Python name as key" in exc.format_message()
    else:
        assert set(parsed) <= {p.partition("=")[0].strip() for p in pairs}


def test_a_package_in_this_directory_but_not_on_the_path_gets_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The README's `--data mypkg.data:make_dataset` failed with "No module named 'mypkg'" for a new user whose
    # mypkg sat in the directory pdprof ran in: the tools run as scripts, so it is not on the import path.
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "data.py").write_text("def make():\n    return None\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and Path(p).resolve() != tmp_path.resolve()])
    with pytest.raises(SpecError) as err:
        resolve_dataset("mypkg.data:make")
    assert str(err.value).endswith(
        "mypkg is in this directory, which is not on the import path: run with PYTHONPATH=. or name the file "
        "(mypkg/data.py:...)"
    ), err.value


def test_a_file_spec_imports_the_files_beside_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A new user's data.py did `from hfdata import tokens` (hfdata.py beside it): "No module named 'hfdata'"
    # unless PYTHONPATH named the folder. A file spec now imports as `python data.py` would.
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "sibling_helpers_xyz.py").write_text("def make(n=3):\n    return list(range(n))\n")
    (folder / "data.py").write_text(
        "from sibling_helpers_xyz import make\n\n\ndef build():\n    return make()\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the insertion stays in this test
    assert resolve_dataset(f"{folder}/data.py:build") == [0, 1, 2]
    assert sys.path[-1] == str(folder.resolve())  # after the installed packages, which it must not shadow
