"""The configuration table (docs/configuration.md) is ServiceConfig's, field for field (generated;
stale when a field is added, renamed or re-described without regenerating it); the README's preset
list is the presets'; and the README stays a short walk in the order a newcomer needs it."""

import re
from pathlib import Path
from typing import get_args, get_origin

import pytest
from pydantic import BaseModel, Field

from vae_service.config import ServiceConfig
from vae_service.config_table import CONFIG_TABLE_END, CONFIG_TABLE_START, config_rows, config_table, replace_table
from vae_service.models.presets import PRESETS

README = Path(__file__).resolve().parents[2] / "README.md"
CONFIGURATION = README.with_name("docs") / "configuration.md"


def readme_table() -> str:
    text = CONFIGURATION.read_text()
    return text[text.index(CONFIG_TABLE_START) + len(CONFIG_TABLE_START) : text.index(CONFIG_TABLE_END)].strip()


def test_the_readme_table_is_the_models():
    assert readme_table() == config_table()
    for document in (README, CONFIGURATION):
        assert replace_table(document.read_text()) == document.read_text()


def test_the_readme_lists_every_preset_generated_from_presets():
    from vae_service.config_table import PRESET_LIST_END, PRESET_LIST_START, preset_list

    text = README.read_text()
    listed = text[text.index(PRESET_LIST_START) + len(PRESET_LIST_START) : text.index(PRESET_LIST_END)].strip()
    assert listed == preset_list()
    assert re.findall(r"`([^`]+)`", listed) == list(PRESETS)  # all of them, in order (22 today)
    grown = text.replace("`sd`, ", "", 1)  # a preset missing from the list: stale, and regenerated
    assert replace_table(grown) == text


def test_every_leaf_field_has_its_row():
    names = [row.split("`")[1] for row in readme_table().splitlines()[2:]]
    assert "limits.max_decode_bytes" in names and "serving.retry_after_s" in names
    leaves = []

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                walk(field.annotation, f"{prefix}{name}.")
                continue
            leaves.append(prefix + name)
            entry = get_args(field.annotation)[1] if get_origin(field.annotation) is dict else None
            if isinstance(entry, type) and issubclass(entry, BaseModel):  # named entries (sinks): an entry's fields
                walk(entry, f"{prefix}{name}.NAME.")

    walk(ServiceConfig)
    assert names == leaves


def test_a_new_field_makes_the_table_stale_and_one_without_a_description_is_refused():
    class Grown(ServiceConfig):
        new_knob: int = Field(3, description="a setting added later")

    assert ("new_knob", "`3`", "a setting added later") in config_rows(Grown)

    class Undocumented(BaseModel):
        knob: int = 1

    with pytest.raises(ValueError, match="knob: a config field needs a description"):
        config_rows(Undocumented)


def test_the_readme_is_a_short_walk_in_order():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings == ["Set-up (fresh machine, Python 3.11+)", "A first decode", "API", "Deploying", "Configuration",
                        "Further reading"]  # fmt: skip
    assert "../shared" not in text and "shared folder" not in text
