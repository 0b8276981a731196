"""The bottom layer: the Parquet tables (schemas, read/write, checks), the run's file layout (`paths`), every seed
(`seeds`), the params section base classes (`section`) and figure saving. Imports nothing of the project."""
