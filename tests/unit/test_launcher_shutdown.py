"""cluster/launcher.py shutdown: a deploy that failed before Serve started has nothing to delete
(the failure that got there is the one reported: test_serve_start_errors.py runs that on a real
Ray); any other error of Serve's delete is raised, not swallowed. serve.delete and kill_hub are
replaced by recorders so no Ray is needed."""

import pytest
from ray import serve
from ray.serve.exceptions import RayServeException

from kvmesh.cluster import event_hub, launcher
from kvmesh.serve_config import ServeConfig


def deleting_raises(monkeypatch, message: str) -> list[str]:
    killed = []

    def delete(name):
        raise RayServeException(message)

    monkeypatch.setattr(serve, "delete", delete)
    monkeypatch.setattr(event_hub, "kill_hub", lambda name: killed.append(name) or True)
    return killed


def test_no_serve_running_is_passed_over_and_the_hub_still_killed(monkeypatch):
    killed = deleting_raises(monkeypatch, "There is no Serve instance running on this Ray cluster.")
    launcher.shutdown(ServeConfig(), own_ray=False)
    assert killed == [ServeConfig().app_name]


def test_another_serve_error_is_raised(monkeypatch):
    killed = deleting_raises(monkeypatch, "Failed to delete the application: the controller died")
    with pytest.raises(RayServeException, match="controller died"):
        launcher.shutdown(ServeConfig(), own_ray=False)
    assert killed == []
