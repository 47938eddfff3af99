"""What every section of the configuration shares: unknown keys refused, assignments validated, and
the two value types several sections declare (a device, an on/off word)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict

from opsd.devices import check_device_setting

# A device setting (auto | cpu | cuda | cuda:N), checked where every config declares one.
DeviceSetting = Annotated[str, AfterValidator(check_device_setting)]


def switch_word(value: Any) -> Any:
    """YAML 1.1 reads a bare ``on``/``off`` as true/false: the word back, for a setting spelled with it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


# A choice among words that include on/off, which a YAML file or a dotted override may write bare.
Switch = BeforeValidator(switch_word)


class Section(BaseModel):
    """A section of a configuration: an unknown key is an error naming it, an assignment is validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
