"""One partition's pipeline: fetcher -> dispatcher -> tracker -> committer, with its lease."""
