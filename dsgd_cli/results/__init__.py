"""The results database and the answers drawn from it.

database.py says where a database is and opens it (`--db` paths and URLs, SQLAlchemy
engines); schema.py names its tables and columns; store.py writes it (`ResultsWriter`: the
SQLAlchemy 2.x models, migrations, every write); reader.py reads it (`ResultsReader`) in
plain SQL for the commands that only read (an SQLite file through Python's `sqlite3`, without
loading SQLAlchemy); strictjson.py writes JSON without NaN or infinity; query.py selects runs
(`--where`, tags); analysis.py tabulates final values and baselines (the table of `compare`
and of `dsgd run`'s end); history.py asks a run's metric history (when a target was reached,
curves, bytes); plotting.py draws curves; advice.py fits the models of `dsgd advise`.
"""
