"""The core's tables (lists of row dicts) as Dagster table metadata, each column saying what it counts."""

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

_TYPES = {bool: "bool", int: "int", float: "float", str: "string"}


def records_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str]) -> dg.MetadataValue:
    """`rows` as a table of exactly `columns` (name -> what the column counts, shown as the column's description);
    a column's type is that of its first non-empty value."""

    def kind(name: str) -> str:
        value = next((r[name] for r in rows if r.get(name) is not None), "")
        return _TYPES.get(type(value), "string")

    schema = dg.TableSchema(columns=[dg.TableColumn(n, kind(n), description=d) for n, d in columns.items()])
    records = [dg.TableRecord({n: r.get(n) for n in columns}) for r in rows]
    return dg.MetadataValue.table(records=records, schema=schema)
