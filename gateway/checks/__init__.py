"""`python -m gateway check-config`'s checks, each against the gateway's own settings.

`settings` prints the settings in force (secrets masked) and warns where they
disagree; `probe` (`--probe`) asks each backend what it serves and how fast it
prefills; `nginx` (`--nginx FILE`) reads an nginx config in front of the gateway for
timeouts, buffering and body limits that would cut what the gateway still answers.
"""
