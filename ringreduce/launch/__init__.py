"""The launcher `ringrun` (ringrun.py), the guard around each rank (guard.py), and elastic jobs'
launcher and rendezvous server (elastic_launcher.py, rendezvous_server.py)."""
