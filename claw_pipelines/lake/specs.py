"""Where curation specs are kept: `specs/<name>.yaml` in the lake, plus the built-in ones
(`default`, always built; `sft-successes` and `preference-pairs`, built once added), the
spec model itself being claw_pipelines.contracts.specs."""

from __future__ import annotations

from dataclasses import dataclass

import yaml
from pydantic import ValidationError

from claw_pipelines.contracts.errors import SpecError
from claw_pipelines.contracts.specs import BUILTIN_SPECS, DEFAULT_SPEC, CurationSpec
from claw_pipelines.lake.delta import Lake

SPEC_FOLDER = "specs"


def spec_path(name: str) -> str:
    """Where spec `name` lives under the lake root."""
    return f"{SPEC_FOLDER}/{name}.yaml"


def validate_spec(fields: dict) -> CurationSpec:
    """A spec from its fields; a SpecError names the first bad field."""
    try:
        return CurationSpec.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise SpecError(f"{field}: {message}" if field else message) from None


def parse_spec(text: str, expected_name: str | None = None) -> CurationSpec:
    """A spec from YAML; errors name the field (`reward_min: Input should be a number`)."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SpecError(f"not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise SpecError("a spec is a YAML mapping of fields")
    if expected_name is not None:
        raw.setdefault("name", expected_name)
    spec = validate_spec(raw)
    if expected_name is not None and spec.name != expected_name:
        raise SpecError(f"name: {spec.name!r} does not match its file {expected_name}.yaml")
    return spec


def to_yaml(spec: CurationSpec) -> str:
    """The spec as YAML (unset fields left out)."""
    return yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=True), sort_keys=False)


def save_spec(lake: Lake, spec: CurationSpec | dict) -> CurationSpec:
    """Validate and store a spec as `specs/<name>.yaml`; return it."""
    if isinstance(spec, dict):
        spec = validate_spec(spec)
    lake.write_text(spec_path(spec.name), to_yaml(spec))
    return spec


@dataclass(frozen=True)
class SpecShelf:
    """The lake's specs: those that validate, and for each file that does not, its error."""

    specs: dict[str, CurationSpec]
    errors: dict[str, SpecError]  # by dataset name; the message names the file and field


def read_specs(lake: Lake) -> SpecShelf:
    """Every spec file, each validated on its own: one bad file never hides the others."""
    specs, errors = {DEFAULT_SPEC.name: DEFAULT_SPEC}, {}
    for path in lake.list_files(SPEC_FOLDER, ".yaml"):
        name = path.rsplit("/", 1)[-1].removesuffix(".yaml")
        try:
            specs[name] = _parse_file(path, name, lake.read_text(path) or "")
        except SpecError as exc:
            specs.pop(name, None)  # a broken `default.yaml` does not fall back silently
            errors[name] = exc
    return SpecShelf(specs, errors)


def _parse_file(path: str, name: str, text: str) -> CurationSpec:
    try:
        return parse_spec(text, expected_name=name)
    except SpecError as exc:
        raise SpecError(f"{path}: {exc}") from None


def load_specs(lake: Lake) -> dict[str, CurationSpec]:
    """Every valid spec: the built-in `default` and the lake's (a lake spec may replace
    `default`); invalid files are left out (`read_specs` tells why)."""
    return read_specs(lake).specs


def load_spec(lake: Lake, name: str) -> CurationSpec:
    """One spec by name, read from its own file only; a SpecError names the file and field."""
    path = spec_path(name)
    text = lake.read_text(path)
    if text is not None:
        return _parse_file(path, name, text)
    if name in BUILTIN_SPECS:
        return BUILTIN_SPECS[name]
    known = sorted(set(read_specs(lake).specs) | set(BUILTIN_SPECS))
    raise SpecError(f"no spec named {name!r} (known: {', '.join(known)})")


def add_builtin(lake: Lake, name: str) -> CurationSpec:
    """Store a built-in spec in the lake, so its dataset is built from now on."""
    if name not in BUILTIN_SPECS:
        raise SpecError(f"no built-in spec named {name!r} (built in: {', '.join(BUILTIN_SPECS)})")
    return save_spec(lake, BUILTIN_SPECS[name])
