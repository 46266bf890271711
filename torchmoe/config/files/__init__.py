"""The files a job names, reads and writes: what the OS refuses about a path, as one
`ConfigError` naming its key (`paths`); regular files only (`file_kinds`); text as UTF-8 (`text`);
JSON and TOML parsed within bounds (`nesting`); the digest of a file (`digests`); the run's own
writes, never through a symbolic link nor half-written (`file_writes`); who holds a folder
(`folder_owners`); and the files a command writes where its user says (`output_files`).
"""
