"""The base of every config section: strict (unknown keys are errors), validated on assignment, and
documented by its attribute docstrings."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True,
                              use_attribute_docstrings=True)
