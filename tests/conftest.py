"""Test collection: the recovery workers are scripts run by the tests, not modules to import."""

collect_ignore_glob = ["_recovery_scripts/*"]
