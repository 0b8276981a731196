"""The SQL environment's oracle (LearNAT's AST guidance): a query's components from its syntax tree (`sqlglot`), what
an executed query covers of them, and the expert's decomposition of a gold query (docs/environments.md, "SQL").

A query is first normalised: parsed as SQLite, table aliases replaced by the tables' names (kept where one table
appears twice in a FROM), columns qualified by their table (from the schema where the query leaves them
unqualified), identifiers lowercased; a component is printed from the normalised tree, so `T1.name` and
`student.name` and `Name` are one component. A gold query's components:

- `from:<table>` for each table a SELECT reads, and `query:<subquery>` for each nested query (a subquery anywhere,
  each branch of a set operation, a derived table), whose own components count too;
- `join:<a = b>` for each join condition (an equality of two tables' columns in ON or WHERE, operands sorted);
- `where:<predicate>` for each conjunct of WHERE, `having:<predicate>` for each of HAVING;
- `group:<expr>`, `order:<expr [DESC]>`, `limit:<n>`;
- `select:<projection>` for the outermost SELECT, `setop:<union | union all | intersect | except>` for a set
  operation.

An executed query covers the components it has, together with `query:` of itself and of every query in it. The
oracle distance is the gold components no executed query has covered, plus one for the answer.

The expert's decomposition lists queries that each add one component to those before them: the tables one by one,
the joins, every nested query (innermost first, each ending with the subquery itself), each WHERE conjunct, the
grouping, HAVING, ORDER BY and LIMIT, all as `SELECT *`, then the projection; for a set operation, each branch's
chain and then the whole. Played from the start, it covers one new component a turn, so the expert reaches the
answer in exactly the oracle distance.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping

import sqlglot
from sqlglot import exp

Schema = Mapping[str, tuple[str, ...]]     # table -> columns, lowercased
QUERY = (exp.Select, exp.SetOperation)


def parse(query: str, schema: Schema | None = None) -> exp.Expression | None:
    """The normalised tree of one SQLite statement, or None where it does not parse as one query."""
    try:
        trees = [t for t in sqlglot.parse(query, read="sqlite") if t is not None]
    except (sqlglot.errors.ParseError, sqlglot.errors.TokenError, ValueError, RecursionError):
        return None
    if len(trees) != 1 or not isinstance(trees[0], QUERY):
        return None
    return _normalise(trees[0], schema or {})


def sql(node: exp.Expression) -> str:
    return node.sql(dialect="sqlite")


def _tables(select: exp.Select) -> list[exp.Expression]:
    """The FROM and JOIN sources of one SELECT (tables and derived tables)."""
    src = []
    f = select.args.get("from_")
    if f is not None:
        src.append(f.this)
    src += [j.this for j in select.args.get("joins") or []]
    return src


def _normalise(tree: exp.Expression, schema: Schema) -> exp.Expression:
    tree = tree.copy()
    for ident in tree.find_all(exp.Identifier):
        ident.set("this", ident.name.lower())
        ident.set("quoted", False)
    aliases: dict[int, dict[str, str]] = {}          # id(select) -> alias -> table
    for select in tree.find_all(exp.Select):
        names = [t.name for t in _tables(select) if isinstance(t, exp.Table)]
        repeated = {n for n, k in Counter(names).items() if k > 1}
        amap = {}
        for t in _tables(select):
            if isinstance(t, exp.Table):
                amap[t.alias_or_name] = t.name
                if t.alias and t.name not in repeated:
                    amap[t.alias] = t.name
                    t.set("alias", None)
        aliases[id(select)] = amap
    for col in list(tree.find_all(exp.Column)):
        scopes = []
        node = col.parent
        while node is not None:
            if isinstance(node, exp.Select):
                scopes.append(node)
            node = node.parent
        if not scopes:
            continue
        if col.table:
            for s in scopes:                          # the nearest SELECT that names the alias (correlated too)
                if col.table in aliases[id(s)]:
                    col.set("table", exp.to_identifier(aliases[id(s)][col.table]))
                    break
            continue
        own = [t.name for t in _tables(scopes[0]) if isinstance(t, exp.Table)]
        having = [t for t in own if col.name in schema.get(t, ())]
        if len(set(own)) == 1 and (not schema or having):
            col.set("table", exp.to_identifier(own[0]))
        elif len(set(having)) == 1:
            col.set("table", exp.to_identifier(having[0]))
    return tree


def _conjuncts(node: exp.Expression | None) -> list[exp.Expression]:
    if node is None:
        return []
    node = node.this if isinstance(node, (exp.Where, exp.Having)) else node
    return list(node.flatten()) if isinstance(node, exp.And) else [node]


def _inner(node: exp.Expression) -> Iterator[exp.Expression]:
    """The outermost queries nested in `node` (not their own nested ones)."""
    for child in node.iter_expressions():
        if isinstance(child, QUERY):
            yield child
        else:
            yield from _inner(child)


def _join_key(pred: exp.Expression) -> str | None:
    """`join:` of an equality between columns of two different tables, operands sorted; None otherwise."""
    if isinstance(pred, exp.EQ) and isinstance(pred.this, exp.Column) and isinstance(pred.expression, exp.Column):
        a, b = sql(pred.this), sql(pred.expression)
        if pred.this.table != pred.expression.table:
            return "join:" + " = ".join(sorted((a, b)))
    return None


def _projection(select: exp.Select) -> str:
    distinct = "distinct " if select.args.get("distinct") else ""
    return "select:" + distinct + ", ".join(sql(e) for e in select.expressions)


def _setop(node: exp.SetOperation) -> str:
    kind = type(node).__name__.lower()
    return f"setop:{kind}" + (" all" if kind == "union" and not node.args.get("distinct") else "")


def components(node: exp.Expression, top: bool = True) -> set[str]:
    """The components of a normalised query (`top`: it is the outermost one, whose projection is a component)."""
    out: set[str] = set()
    if isinstance(node, exp.SetOperation):
        out.add(_setop(node))
        for branch in (node.this, node.expression):
            out.add("query:" + sql(branch))
            out |= components(branch, top=False)
        return out
    if not isinstance(node, exp.Select):
        return out
    for t in _tables(node):
        if isinstance(t, exp.Table):
            out.add(f"from:{t.name}")
        else:
            for q in ([t] if isinstance(t, QUERY) else list(_inner(t))):
                out.add("query:" + sql(q))
                out |= components(q, top=False)
    for j in node.args.get("joins") or []:
        for pred in _conjuncts(j.args.get("on")):
            out.add(_join_key(pred) or "join:" + sql(pred))
    for pred in _conjuncts(node.args.get("where")):
        out.add(_join_key(pred) or "where:" + sql(pred))
    for pred in _conjuncts(node.args.get("having")):
        out.add("having:" + sql(pred))
    group = node.args.get("group")
    if group is not None:
        out |= {"group:" + sql(e) for e in group.expressions}
    order = node.args.get("order")
    if order is not None:
        out |= {"order:" + sql(e) for e in order.expressions}
    if node.args.get("limit") is not None:
        out.add("limit:" + sql(node.args["limit"].expression))
    if top:
        out.add(_projection(node))
    for clause in ("where", "having", "expressions"):
        value = node.args.get(clause)
        for part in (value if isinstance(value, list) else [value] if value is not None else []):
            for q in ([part] if isinstance(part, QUERY) else _inner(part)):
                out.add("query:" + sql(q))
                out |= components(q, top=False)
    return out


def covered(node: exp.Expression) -> set[str]:
    """What an executed (normalised) query covers: its components, with `query:` of itself."""
    return components(node) | {"query:" + sql(node)}


def _star(select: exp.Select, clauses: dict) -> exp.Select:
    """`SELECT *` over `select`'s sources with only the given clauses."""
    q = exp.Select(expressions=[exp.Star()])
    for k, v in clauses.items():
        if v is not None:
            q.set(k, v.copy() if isinstance(v, exp.Expression) else [x.copy() for x in v])
    return q


def decomposition(node: exp.Expression) -> list[exp.Expression]:
    """The expert's queries for a normalised gold query, ending with the query itself."""
    if isinstance(node, exp.SetOperation):
        return decomposition(node.this) + decomposition(node.expression) + [node]
    if not isinstance(node, exp.Select):
        return [node]
    steps: list[exp.Expression] = []
    sources = _tables(node)
    joins = node.args.get("joins") or []
    base = node.args.get("from_")
    for t in sources:
        if isinstance(t, exp.Table):
            steps.append(_star(node, {"from_": exp.From(this=t.copy())}))
        else:
            for q in ([t] if isinstance(t, QUERY) else list(_inner(t))):
                steps += decomposition(q)
    for k in range(1, len(joins) + 1):
        steps.append(_star(node, {"from_": base, "joins": joins[:k]}))
    clauses = {"from_": base, "joins": joins or None}
    where = _conjuncts(node.args.get("where"))
    for k, pred in enumerate(where, 1):
        for q in _inner(pred):
            steps += decomposition(q)
        steps.append(_star(node, clauses | {"where": exp.Where(this=exp.and_(*[p.copy() for p in where[:k]]))}))
    clauses["where"] = node.args.get("where")
    for key in ("group", "having", "order", "limit"):
        value = node.args.get(key)
        if value is None:
            continue
        if key == "having":
            for q in _inner(value):
                steps += decomposition(q)
        clauses[key] = value
        steps.append(_star(node, clauses))
    return steps + [node]
