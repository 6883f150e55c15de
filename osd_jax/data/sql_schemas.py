"""Small sqlite schemas with deterministic rows, for generated text-to-SQL questions."""

from __future__ import annotations

import dataclasses
import itertools
import random
import sqlite3

_FIRST = (
    "Ana",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Gus",
    "Hana",
    "Ivan",
    "Jin",
    "Kofi",
    "Lena",
    "Marco",
    "Nia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Wen",
    "Yusuf",
)
_LAST = (
    "Adams",
    "Baker",
    "Costa",
    "Diaz",
    "Evans",
    "Fischer",
    "Garcia",
    "Hughes",
    "Ito",
    "Jones",
    "Kim",
    "Lopez",
    "Moreau",
    "Novak",
    "Okafor",
    "Patel",
    "Rossi",
    "Silva",
    "Tanaka",
    "Weber",
)
_ADJECTIVES = (
    "Silent",
    "Golden",
    "Hidden",
    "Broken",
    "Distant",
    "Crimson",
    "Quiet",
    "Endless",
    "Frozen",
    "Bright",
    "Lost",
    "Iron",
    "Paper",
    "Velvet",
    "Wild",
    "Hollow",
)
_NOUNS = (
    "River",
    "Garden",
    "Empire",
    "Harbor",
    "Forest",
    "Mirror",
    "Tower",
    "Winter",
    "Signal",
    "Orchard",
    "Compass",
    "Lantern",
    "Island",
    "Meadow",
    "Engine",
    "Voyage",
)
_CITIES = (
    "Lisbon",
    "Osaka",
    "Nairobi",
    "Toronto",
    "Lyon",
    "Austin",
    "Pune",
    "Seoul",
    "Quito",
    "Oslo",
)


@dataclasses.dataclass(frozen=True)
class Column:
  """One column; `kind` says which questions it can take part in."""

  name: str
  kind: str  # "id" | "name" | "category" | "number" | "foreign_key"
  desc: str = ""  # How a question refers to it, e.g. "salary".
  values: tuple = ()  # Category choices, or the name pool.
  low: float = 0
  high: float = 0
  real: bool = False  # REAL rounded to one decimal, else INTEGER.
  ref: str = ""  # Table a foreign key points to.

  @property
  def sql_type(self) -> str:
    """The declared sqlite type."""
    if self.kind in ("id", "foreign_key"):
      return "INTEGER"
    if self.kind == "number":
      return "REAL" if self.real else "INTEGER"
    return "TEXT"


@dataclasses.dataclass(frozen=True)
class Table:
  """A table, how questions name its rows, and how many rows it gets."""

  name: str
  singular: str
  plural: str
  columns: tuple[Column, ...]
  num_rows: int

  def of_kind(self, kind: str) -> list[Column]:
    """Columns of one kind, in declaration order."""
    return [c for c in self.columns if c.kind == kind]

  @property
  def label(self) -> Column:
    """The column that names a row (a person's name, a book's title)."""
    return self.of_kind("name")[0]


@dataclasses.dataclass(frozen=True)
class Schema:
  """A database: tables in creation order (parents before children)."""

  name: str
  tables: tuple[Table, ...]

  def table(self, name: str) -> Table:
    """The table called `name`."""
    return next(t for t in self.tables if t.name == name)

  def ddl(self) -> str:
    """CREATE TABLE statements, as a prompt shows the schema."""
    statements = []
    for table in self.tables:
      parts = []
      for c in table.columns:
        if c.kind == "id":
          parts.append(f"{c.name} INTEGER PRIMARY KEY")
        elif c.kind == "foreign_key":
          parts.append(f"{c.name} INTEGER REFERENCES {c.ref}(id)")
        else:
          parts.append(f"{c.name} {c.sql_type}")
      statements.append(f"CREATE TABLE {table.name} ({', '.join(parts)});")
    return "\n".join(statements)


def format_prompt(ddl: str, question: str) -> str:
  """The user's request: schema, question, and what to return (Spider's prompts use it too)."""
  return (
      f"Given this SQLite database schema:\n\n{ddl}\n\n"
      f"Write an SQL query that answers the question: {question}"
  )


def _people() -> tuple[str, ...]:
  return tuple(f"{a} {b}" for a, b in itertools.product(_FIRST, _LAST))


def _titles() -> tuple[str, ...]:
  return tuple(f"The {a} {b}" for a, b in itertools.product(_ADJECTIVES, _NOUNS))


def _id() -> Column:
  return Column("id", "id")


def default_schemas() -> tuple[Schema, ...]:
  """The schemas the SQL data set asks about: school, shop, library, flights."""
  people, titles = _people(), _titles()
  school = Schema(
      "school",
      (
          Table(
              "departments",
              "department",
              "departments",
              (
                  _id(),
                  Column(
                      "name",
                      "name",
                      "names",
                      (
                          "Physics",
                          "History",
                          "Biology",
                          "Economics",
                          "Music",
                          "Chemistry",
                          "Philosophy",
                          "Statistics",
                      ),
                  ),
                  Column(
                      "building",
                      "category",
                      "building",
                      ("North Hall", "South Hall", "Main Building"),
                  ),
                  Column("budget", "number", "budget", low=50_000, high=900_000),
              ),
              8,
          ),
          Table(
              "instructors",
              "instructor",
              "instructors",
              (
                  _id(),
                  Column("name", "name", "names", people),
                  Column("department_id", "foreign_key", ref="departments"),
                  Column("salary", "number", "salary", low=40_000, high=160_000),
                  Column("hire_year", "number", "hiring year", low=1990, high=2023),
              ),
              30,
          ),
          Table(
              "students",
              "student",
              "students",
              (
                  _id(),
                  Column("name", "name", "names", people),
                  Column("department_id", "foreign_key", ref="departments"),
                  Column(
                      "gpa",
                      "number",
                      "grade point average",
                      low=1.5,
                      high=4.0,
                      real=True,
                  ),
                  Column(
                      "year",
                      "category",
                      "study year",
                      ("freshman", "sophomore", "junior", "senior"),
                  ),
              ),
              60,
          ),
      ),
  )
  shop = Schema(
      "shop",
      (
          Table(
              "customers",
              "customer",
              "customers",
              (
                  _id(),
                  Column("name", "name", "names", people),
                  Column("city", "category", "city", _CITIES),
                  Column("signup_year", "number", "sign-up year", low=2012, high=2024),
              ),
              40,
          ),
          Table(
              "orders",
              "order",
              "orders",
              (
                  _id(),
                  Column(
                      "reference",
                      "name",
                      "references",
                      tuple(f"ORD-{i:04d}" for i in range(1000, 2000)),
                  ),
                  Column("customer_id", "foreign_key", ref="customers"),
                  Column(
                      "status",
                      "category",
                      "status",
                      ("pending", "shipped", "delivered", "returned"),
                  ),
                  Column("total", "number", "total amount", low=5, high=900, real=True),
                  Column("quantity", "number", "quantity", low=1, high=12),
              ),
              120,
          ),
      ),
  )
  library = Schema(
      "library",
      (
          Table(
              "authors",
              "author",
              "authors",
              (
                  _id(),
                  Column("name", "name", "names", people),
                  Column(
                      "country",
                      "category",
                      "country",
                      ("Brazil", "Japan", "Kenya", "Canada", "France", "India"),
                  ),
                  Column("birth_year", "number", "birth year", low=1920, high=1995),
              ),
              25,
          ),
          Table(
              "books",
              "book",
              "books",
              (
                  _id(),
                  Column("title", "name", "titles", titles),
                  Column("author_id", "foreign_key", ref="authors"),
                  Column(
                      "genre",
                      "category",
                      "genre",
                      ("mystery", "poetry", "history", "science", "fantasy"),
                  ),
                  Column("pages", "number", "page count", low=80, high=900),
                  Column(
                      "published_year",
                      "number",
                      "publication year",
                      low=1950,
                      high=2024,
                  ),
              ),
              90,
          ),
      ),
  )
  flights = Schema(
      "flights",
      (
          Table(
              "airlines",
              "airline",
              "airlines",
              (
                  _id(),
                  Column(
                      "name",
                      "name",
                      "names",
                      tuple(f"{c} Air" for c in _CITIES) + ("Polar Wings", "Sunline"),
                  ),
                  Column(
                      "alliance",
                      "category",
                      "alliance",
                      ("Star", "Oneworld", "SkyTeam", "none"),
                  ),
                  Column("fleet_size", "number", "fleet size", low=10, high=400),
              ),
              10,
          ),
          Table(
              "flights",
              "flight",
              "flights",
              (
                  _id(),
                  Column(
                      "number",
                      "name",
                      "flight numbers",
                      tuple(f"FL{i}" for i in range(100, 1000)),
                  ),
                  Column("airline_id", "foreign_key", ref="airlines"),
                  Column("destination", "category", "destination", _CITIES),
                  Column(
                      "distance",
                      "number",
                      "distance in kilometres",
                      low=200,
                      high=12_000,
                  ),
                  Column(
                      "passengers", "number", "number of passengers", low=20, high=420
                  ),
              ),
              150,
          ),
      ),
  )
  return school, shop, library, flights


def generate_rows(schema: Schema, seed: int = 0) -> dict[str, list[dict]]:
  """Deterministic rows for every table; labels are unique within a table."""
  rng = random.Random(f"{schema.name}-{seed}")
  rows: dict[str, list[dict]] = {}
  for table in schema.tables:
    labels = rng.sample(table.label.values, table.num_rows)
    table_rows = []
    for index in range(table.num_rows):
      row: dict = {}
      for c in table.columns:
        if c.kind == "id":
          row[c.name] = index + 1
        elif c.kind == "name":
          row[c.name] = labels[index]
        elif c.kind == "category":
          row[c.name] = rng.choice(c.values)
        elif c.kind == "foreign_key":
          row[c.name] = rng.randint(1, len(rows[c.ref]))
        elif c.real:
          row[c.name] = round(rng.uniform(c.low, c.high), 1)
        else:
          row[c.name] = rng.randint(int(c.low), int(c.high))
      table_rows.append(row)
    rows[table.name] = table_rows
  return rows


def create_database(schema: Schema, rows: dict[str, list[dict]]) -> sqlite3.Connection:
  """An in-memory sqlite database holding `rows`."""
  connection = sqlite3.connect(":memory:")
  connection.executescript(schema.ddl())
  for table in schema.tables:
    names = [c.name for c in table.columns]
    connection.executemany(
        f"INSERT INTO {table.name} ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
        [tuple(row[n] for n in names) for row in rows[table.name]],
    )
  connection.commit()
  return connection
