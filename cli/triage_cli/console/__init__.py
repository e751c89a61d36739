"""`triage console`: a web page for operators, served by the CLI on loopback.

    command.py      the `triage console` command: settings, the server, the login URL
    server.py       the aiohttp application: pages, the JSON API, security headers
    auth.py         the login token, session cookies and CSRF tokens (pure)
    sampler.py      the one background task that reads the fleet every few seconds
    history.py      the last hour of samples: lag, rates, rebalances (pure)
    deadletters.py  the console's one door to the dead-letter table (the store routines
                    `triage dlq` uses: selection, claims, replay, discard)
    jobs.py         bulk replay and discard running in the background, with progress
    static/         HTML shells, the script and style that fill them, and the vendored
                    chart library (uPlot, with its licence)

Nothing a record carries reaches the page as markup: the server sends JSON and the
scripts build the DOM with `textContent`; the Content-Security-Policy allows scripts and
styles from the console itself only. See docs/console.md.
"""
