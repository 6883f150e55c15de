"""Text-to-SQL queries: questions over small sqlite schemas, each with a gold query that runs."""

from __future__ import annotations

import random
import sqlite3
from typing import Callable, Iterator

from osd_jax.data import common
from osd_jax.data.builder import QueryBuilder
from osd_jax.data.sql_schemas import (
    Column,
    Schema,
    Table,
    create_database,
    default_schemas,
    format_prompt,
    generate_rows,
)

Rows = dict[str, list[dict]]
# A template fills a question and its gold SQL from the schema and its rows,
# or returns None when the schema has nothing it can ask about.
Template = Callable[[random.Random, Schema, Rows], "tuple[str, str] | None"]
_AGGREGATES = (
    ("average", "AVG"),
    ("highest", "MAX"),
    ("lowest", "MIN"),
    ("total", "SUM"),
)
# Candidates tried per example wanted; questions repeat once a schema is exhausted.
_OVERSAMPLE = 20


def _quote(value: object) -> str:
  """A SQL literal; strings get single quotes doubled."""
  if isinstance(value, str):
    return "'" + value.replace("'", "''") + "'"
  return str(value)


def _pick(rng: random.Random, schema: Schema, kind: str) -> tuple[Table, Column] | None:
  """A random table and one of its columns of `kind`."""
  options = [(t, c) for t in schema.tables for c in t.of_kind(kind)]
  return rng.choice(options) if options else None


def _parent(rng: random.Random, schema: Schema) -> tuple[Table, Column, Table] | None:
  """A random child table, its foreign key, and the parent it points to."""
  picked = _pick(rng, schema, "foreign_key")
  return None if picked is None else (picked[0], picked[1], schema.table(picked[1].ref))


def _value(rng: random.Random, rows: Rows, table: Table, column: Column) -> object:
  # Values are drawn from the rows themselves so that filters select something.
  return rng.choice(rows[table.name])[column.name]


def _threshold(
    rng: random.Random, rows: Rows, table: Table, column: Column
) -> float | int:
  """A number to compare with: a stored value, or a round number in the column's range."""
  if rng.random() < 0.5:
    return _value(rng, rows, table, column)
  if column.real:
    return round(rng.uniform(column.low, column.high), 1)
  step = 10 ** max(0, len(str(int(column.high - column.low))) - 2)
  return rng.randrange(int(column.low) // step, int(column.high) // step + 1) * step


def count_all(rng, schema, rows):
  table = rng.choice(schema.tables)
  return f"How many {table.plural} are there?", f"SELECT COUNT(*) FROM {table.name}"


def count_above(rng, schema, rows):
  table, column = _pick(rng, schema, "number")
  v = _threshold(rng, rows, table, column)
  return (
      f"How many {table.plural} have a {column.desc} greater than {v}?",
      f"SELECT COUNT(*) FROM {table.name} WHERE {column.name} > {v}",
  )


def names_below(rng, schema, rows):
  table, column = _pick(rng, schema, "number")
  v = _threshold(rng, rows, table, column)
  return (
      f"List the {table.label.desc} of all {table.plural} with a {column.desc} below {v}.",
      f"SELECT {table.label.name} FROM {table.name} WHERE {column.name} < {v}",
  )


def aggregate(rng, schema, rows):
  table, column = _pick(rng, schema, "number")
  word, function = rng.choice(_AGGREGATES)
  return (
      f"What is the {word} {column.desc} of all {table.plural}?",
      f"SELECT {function}({column.name}) FROM {table.name}",
  )


def top_k(rng, schema, rows):
  table, column = _pick(rng, schema, "number")
  k = rng.randint(2, 5)
  order, word = rng.choice((("DESC", "highest"), ("ASC", "lowest")))
  return (
      f"Which {k} {table.plural} have the {word} {column.desc}? Give their {table.label.desc}.",
      f"SELECT {table.label.name} FROM {table.name} ORDER BY {column.name} {order} LIMIT {k}",
  )


def count_category(rng, schema, rows):
  table, column = _pick(rng, schema, "category")
  v = _value(rng, rows, table, column)
  return (
      f"How many {table.plural} have the {column.desc} '{v}'?",
      f"SELECT COUNT(*) FROM {table.name} WHERE {column.name} = {_quote(v)}",
  )


def group_by_category(rng, schema, rows):
  table, column = _pick(rng, schema, "category")
  return (
      f"For each {column.desc}, how many {table.plural} are there?",
      f"SELECT {column.name}, COUNT(*) FROM {table.name} GROUP BY {column.name}",
  )


def names_of_parent(rng, schema, rows):
  picked = _parent(rng, schema)
  if picked is None:
    return None
  child, key, parent = picked
  v = _value(rng, rows, parent, parent.label)
  return (
      f"List the {child.label.desc} of the {child.plural} of the {parent.singular} '{v}'.",
      f"SELECT c.{child.label.name} FROM {child.name} AS c JOIN {parent.name} AS p "
      f"ON c.{key.name} = p.id WHERE p.{parent.label.name} = {_quote(v)}",
  )


def count_per_parent(rng, schema, rows):
  picked = _parent(rng, schema)
  if picked is None:
    return None
  child, key, parent = picked
  return (
      f"How many {child.plural} does each {parent.singular} have? "
      f"Show the {parent.singular}'s {parent.label.desc[:-1]} and the count.",
      f"SELECT p.{parent.label.name}, COUNT(*) FROM {parent.name} AS p JOIN {child.name} AS c "
      f"ON c.{key.name} = p.id GROUP BY p.id",
  )


def parents_having(rng, schema, rows):
  picked = _parent(rng, schema)
  if picked is None:
    return None
  child, key, parent = picked
  n = rng.randint(1, max(1, len(rows[child.name]) // len(rows[parent.name])))
  return (
      f"Which {parent.plural} have more than {n} {child.plural}? Give their {parent.label.desc}.",
      f"SELECT p.{parent.label.name} FROM {parent.name} AS p JOIN {child.name} AS c "
      f"ON c.{key.name} = p.id GROUP BY p.id HAVING COUNT(*) > {n}",
  )


def aggregate_of_parent(rng, schema, rows):
  picked = _parent(rng, schema)
  numbers = [] if picked is None else picked[0].of_kind("number")
  if not numbers:
    return None
  child, key, parent = picked
  column = rng.choice(numbers)
  word, function = rng.choice(_AGGREGATES)
  v = _value(rng, rows, parent, parent.label)
  return (
      f"What is the {word} {column.desc} of the {child.plural} of the {parent.singular} '{v}'?",
      f"SELECT {function}(c.{column.name}) FROM {child.name} AS c JOIN {parent.name} AS p "
      f"ON c.{key.name} = p.id WHERE p.{parent.label.name} = {_quote(v)}",
  )


def count_by_parent_category(rng, schema, rows):
  picked = _parent(rng, schema)
  categories = [] if picked is None else picked[2].of_kind("category")
  if not categories:
    return None
  child, key, parent = picked
  column = rng.choice(categories)
  v = _value(rng, rows, parent, column)
  return (
      f"How many {child.plural} belong to {parent.plural} with the {column.desc} '{v}'?",
      f"SELECT COUNT(*) FROM {child.name} AS c JOIN {parent.name} AS p "
      f"ON c.{key.name} = p.id WHERE p.{column.name} = {_quote(v)}",
  )


def names_between(rng, schema, rows):
  table, column = _pick(rng, schema, "number")
  low, high = sorted(
      (_threshold(rng, rows, table, column), _threshold(rng, rows, table, column))
  )
  return (
      f"Which {table.plural} have a {column.desc} between {low} and {high}? List their {table.label.desc}.",
      f"SELECT {table.label.name} FROM {table.name} WHERE {column.name} BETWEEN {low} AND {high}",
  )


def category_and_number(rng, schema, rows):
  tables = [t for t in schema.tables if t.of_kind("category") and t.of_kind("number")]
  if not tables:
    return None
  table = rng.choice(tables)
  category, number = rng.choice(table.of_kind("category")), rng.choice(
      table.of_kind("number")
  )
  v, n = _value(rng, rows, table, category), _threshold(rng, rows, table, number)
  word, op = rng.choice((("more than", ">"), ("less than", "<"), ("at least", ">=")))
  return (
      f"How many {table.plural} with the {category.desc} '{v}' have a {number.desc} of {word} {n}?",
      f"SELECT COUNT(*) FROM {table.name} WHERE {category.name} = {_quote(v)} AND {number.name} {op} {n}",
  )


def aggregate_by_category(rng, schema, rows):
  tables = [t for t in schema.tables if t.of_kind("category") and t.of_kind("number")]
  if not tables:
    return None
  table = rng.choice(tables)
  category, number = rng.choice(table.of_kind("category")), rng.choice(
      table.of_kind("number")
  )
  word, function = rng.choice(_AGGREGATES)
  return (
      f"What is the {word} {number.desc} of {table.plural} for each {category.desc}?",
      f"SELECT {category.name}, {function}({number.name}) FROM {table.name} GROUP BY {category.name}",
  )


TEMPLATES: tuple[Template, ...] = (
    count_all,
    count_above,
    names_below,
    aggregate,
    top_k,
    count_category,
    group_by_category,
    names_of_parent,
    count_per_parent,
    parents_having,
    aggregate_of_parent,
    count_by_parent_category,
    names_between,
    category_and_number,
    aggregate_by_category,
)


def run_gold(connection: sqlite3.Connection, query: str) -> list[tuple]:
  """Execute a gold query; any sqlite error means the template is broken."""
  return connection.execute(query).fetchall()


def sql_examples(
    num_candidates: int, seed: int, schemas: tuple[Schema, ...] | None = None
) -> Iterator[common.Example]:
  """Up to `num_candidates` generated questions, each gold query executed before it is kept."""
  schemas = schemas or default_schemas()
  rows = {s.name: generate_rows(s, seed) for s in schemas}
  connections = {s.name: create_database(s, rows[s.name]) for s in schemas}
  rng = random.Random(seed)
  try:
    for index in range(num_candidates):
      schema, template = rng.choice(schemas), rng.choice(TEMPLATES)
      filled = template(rng, schema, rows[schema.name])
      if filled is None:
        continue
      question, query = filled
      run_gold(connections[schema.name], query)
      yield common.make_example(
          id=f"sql-{seed}-{index}",
          prompt=format_prompt(schema.ddl(), question),
          domain="sql",
          language="en",
          answer=query,
          source=f"sqlite:{schema.name}",
      )
  finally:
    for connection in connections.values():
      connection.close()


class SqliteText2Sql(QueryBuilder, skip_registration=True):
  """Text-to-SQL questions over the school, shop, library and flights schemas, hash split."""

  name = "sqlite_text2sql"
  DESCRIPTION = __doc__
  DEFAULT_NUM_TRAIN = 2_000
  DEFAULT_NUM_EVAL = 200

  def _examples(self) -> Iterator[common.Example]:
    config = self.builder_config
    return sql_examples(_OVERSAMPLE * (config.num_train + config.num_eval), config.seed)
