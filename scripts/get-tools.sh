#!/usr/bin/env bash
# Placeholder until the chart work lands: fetches nothing yet.
exit 0
