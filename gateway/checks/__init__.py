"""`python -m gateway check-config`'s checks, each against the gateway's own settings.

`nginx` reads an nginx config in front of the gateway (`--nginx FILE`): timeouts,
buffering and body limits that would cut what the gateway still answers.
"""
