"""`serve run bucketserve.deploy:build_app` / a Serve config file's import_path (docs/ray.md).

A shim so that the Serve import path is short; the code is server/ray_deploy.py."""

from bucketserve.server.ray_deploy import build_app

__all__ = ["build_app"]
