"""Self-upgrade: a release is a zipapp of the plexd package, run by the Python that runs plexd.

    zipapp      build a release from a checkout (reproducible: same code, same bytes, same checksum)
    releases    the release directory and its `current` symlink, switched atomically
    marker      data_dir/upgrade.json: an upgrade between "installed" and its outcome, across the restart
    launcher    what `plexd up` does first: run `current`, or roll back an upgrade that never became healthy
    watch       outside systemd, the detached process that restarts a new version that died at start
    upgrader    the daemon's side: the service.upgrade built-in, the restart, and reporting the outcome
"""
