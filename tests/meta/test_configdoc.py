"""docs/configuration.md is rendered from the config models, and every key in it is described."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from opsd import configdoc
from opsd.config import Config


def test_the_reference_is_current():
    text = configdoc.DOC.read_text(encoding="utf-8") if configdoc.DOC.is_file() else ""
    assert text == configdoc.render(), configdoc.STALE


def test_every_key_is_described_and_every_section_says_what_it_is_for():
    undescribed, undocumented, keys = [], [], []
    for prefix, model in configdoc.sections(Config):
        if not configdoc.section_doc(model):
            undocumented.append(model.__name__)
        for name, field in configdoc.leaves(model):
            keys.append(prefix + name)
            if not (field.description or "").strip():
                undescribed.append(prefix + name)
    assert not undescribed, f"config keys without a description: {undescribed}"
    assert not undocumented, f"config sections without a docstring: {undocumented}"
    assert {"cpu.tuning", "cpu.tune_malloc", "rollout.fold_lora", "loss.products", "model.lora.r"} <= set(
        keys
    )
    text = configdoc.render()
    assert all(f"| `{k}` |" in text for k in keys)


class _Deep(BaseModel):
    """The innermost section."""

    model_config = ConfigDict(extra="forbid")
    ratio: float = Field(0.5, gt=0, le=1, description="A | piped ratio.")


class _Inner(BaseModel):
    """A planted section."""

    model_config = ConfigDict(extra="forbid")
    level: Literal["a", "b"] = Field("a", description="Pick one.")
    count: int | None = Field(None, ge=1, lt=5, description="How many; null: any.")
    names: list[str] = Field(["x"], description="Names.")
    text: str = Field("line one\nline two", description="A long default.")
    deep: _Deep = _Deep()


class _Planted(BaseModel):
    """The planted root."""

    model_config = ConfigDict(extra="forbid")
    seed: int = Field(3, description="A seed.")
    size: int | Literal["auto"] = Field("auto", description="A size.")
    inner: _Inner = _Inner()


def test_render_walks_a_planted_nested_model():
    text = configdoc.render(_Planted, title="Planted")
    assert text.startswith("# Planted\n") and text.endswith("| A \\| piped ratio. |\n")
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## Top level", "## inner", "## inner.deep"]
    for row in (
        "| `seed` | int | `3` | A seed. |",
        '| `size` | int or `"auto"` | `"auto"` | A size. |',
        '| `inner.level` | `"a"`, `"b"` | `"a"` | Pick one. |',
        "| `inner.count` | int in [1, 5) or null | `null` | How many; null: any. |",
        '| `inner.names` | list of str | `["x"]` | Names. |',
        "| `inner.text` | str | see below | A long default. |",
        "| `inner.deep.ratio` | float in (0, 1] | `0.5` | A \\| piped ratio. |",
    ):
        assert row in text, row
    assert "A planted section." in text and "The innermost section." in text
    assert "Default of `inner.text`:\n\n```text\nline one\nline two\n```\n\n## inner.deep" in text
    assert configdoc.render(_Planted, title="Planted") == text


def test_main_writes_and_checks(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    assert configdoc.main(["--check", "--out", str(out)]) == 1
    assert configdoc.STALE in capsys.readouterr().err
    assert configdoc.main(["--out", str(out)]) == 0
    assert configdoc.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text() + "edited\n")
    assert configdoc.main(["--check", "--out", str(out)]) == 1


def test_the_commands_are_documented_with_the_sections_they_read():
    text = configdoc.render()
    assert "## `opsd eval`" in text and "## `opsd sft`" in text
    assert "| `models` | list of str | `[]` |" in text  # a command's own key, described
    assert "`eval.temperature: 0.6`" in text and "`model.lora.enabled: false`" in text  # changed defaults
    assert "`seed`, `device`, `model`, `data`, `eval`, `rollout`, `cpu`" in text
