"""Metadata as people read it: the core's tables (lists of row dicts) as Dagster tables, each column saying what it
counts, and figures rounded to the digits that carry meaning."""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

_TYPES = {bool: "bool", int: "int", float: "float", str: "string"}
FIGURE_DIGITS = 3


def readable(x: float) -> float:
    """`x` to three significant digits, one of 1,000 or more to the unit (0.191, 0.000123, 42.5, 5038.0): a figure in
    the UI is read at a glance and plotted over runs, and the digits past those are noise of the measurement
    (0.19072974054353514, 5037.759754778832). A non-finite value is kept as it is."""
    if not math.isfinite(x) or x == 0:
        return float(x)
    if abs(x) >= 10**FIGURE_DIGITS:
        return float(round(x))
    return float(f"{x:.{FIGURE_DIGITS}g}")


def records_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str]) -> dg.MetadataValue:
    """`rows` as a table of exactly `columns` (name -> what the column counts, shown as the column's description);
    a column's type is that of its first non-empty value."""

    def kind(name: str) -> str:
        value = next((r[name] for r in rows if r.get(name) is not None), "")
        return _TYPES.get(type(value), "string")

    schema = dg.TableSchema(columns=[dg.TableColumn(n, kind(n), description=d) for n, d in columns.items()])
    records = [dg.TableRecord({n: r.get(n) for n in columns}) for r in rows]
    return dg.MetadataValue.table(records=records, schema=schema)
