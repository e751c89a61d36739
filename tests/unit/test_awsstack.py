"""The generated CloudFormation template: cfn-lint clean, one service/listener per partition,
least-privilege policies, and the committed reference copy is fresh."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml
from cfnlint.api import ManualArgs, lint

from triage_cli.aws import _repository_arn, stack_name
from triage_cli.awsstack import REFERENCE_PARTITIONS, REFERENCE_PATH, render, template
from triage_proxy.errors import ConfigError
from triage_proxy.settings import settings_from_dict


def lint_errors(text: str) -> list[str]:
    return [str(m) for m in lint(text, config=ManualArgs(regions=["us-east-1"]))]


@pytest.mark.parametrize("partitions", [1, 3])
def test_rendered_template_passes_cfn_lint(partitions: int) -> None:
    assert lint_errors(render(partitions, 7700)) == []


def test_cfn_lint_does_catch_a_broken_template() -> None:
    broken = render(1, 7700).replace("Protocol: TLS\n", "Protocol: TLZ\n")
    assert broken != render(1, 7700)
    assert any("TLZ" in e for e in lint_errors(broken))


def test_reference_template_in_infra_is_fresh() -> None:
    assert REFERENCE_PATH.read_text() == render(REFERENCE_PARTITIONS, 7700), (
        "infra/triage.yaml is stale: run `.venv/bin/python -m triage_cli.awsstack`"
    )


def test_one_service_target_group_and_listener_per_partition_port() -> None:
    resources = template(3, 9000)["Resources"]
    for p in range(3):
        port = 9000 + p
        assert resources[f"Listener{p}"]["Properties"]["Port"] == port
        assert resources[f"Listener{p}"]["Properties"]["Protocol"] == "TLS"
        assert resources[f"TargetGroup{p}"]["Properties"]["Port"] == port
        container = resources[f"TaskDefinition{p}"]["Properties"]["ContainerDefinitions"][0]
        assert container["PortMappings"] == [{"ContainerPort": port, "Protocol": "tcp"}]
        assert {"Name": "TRIAGE_PARTITION", "Value": str(p)} in container["Environment"]
        # The proxy advertises the NLB's name (its listener port is the container's).
        advertised = {"Fn::GetAtt": ["LoadBalancer", "DNSName"]}
        assert {"Name": "TRIAGE_ADVERTISED_HOST", "Value": advertised} in container["Environment"]
        service = resources[f"Service{p}"]["Properties"]
        assert service["LoadBalancers"][0]["ContainerPort"] == port
    assert "Service3" not in resources
    # only the listener ports are open, and the proxies only to the load balancer
    lb_in = resources["LoadBalancerSecurityGroup"]["Properties"]["SecurityGroupIngress"]
    assert [(r["FromPort"], r["ToPort"]) for r in lb_in] == [(9000, 9002)]
    assert "SecurityGroupIngress" not in resources["ProxySecurityGroup"]["Properties"]
    proxy_in = resources["ProxyIngressFromLoadBalancer"]["Properties"]
    assert (proxy_in["FromPort"], proxy_in["ToPort"]) == (9000, 9002)
    assert proxy_in["SourceSecurityGroupId"] == {
        "Fn::GetAtt": ["LoadBalancerSecurityGroup", "GroupId"]
    }


def _statements(role: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for statement in role["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]:
        if "Fn::If" in statement:
            statement = statement["Fn::If"][1]
        found.append(statement)
    return found


def test_roles_grant_no_wildcard_actions_or_resources_beyond_ecr_login() -> None:
    resources = template(1, 7700)["Resources"]
    for role in ("TaskRole", "ExecutionRole"):
        for statement in _statements(resources[role]):
            actions = statement["Action"]
            for action in [actions] if isinstance(actions, str) else actions:
                assert "*" not in action
            if statement["Resource"] == "*":
                assert statement["Action"] == "ecr:GetAuthorizationToken"
    task = {a for s in _statements(resources["TaskRole"]) for a in as_list(s["Action"])}
    assert "dynamodb:Scan" not in task
    assert "dynamodb:DeleteTable" not in task
    assert "secretsmanager:GetSecretValue" in task


def as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def test_template_parses_as_plain_yaml() -> None:
    parsed = yaml.safe_load(render(2, 7700))
    assert set(parsed["Outputs"]) >= {
        "ConsumerEndpoint",
        "Partition0Endpoint",
        "Partition1Endpoint",
    }


def _settings(topic: str, group: str = "g", **aws: Any) -> Any:
    return settings_from_dict(
        {
            "kafka": {"bootstrap_servers": "k:9092", "topic": topic, "group_id": group},
            "auth": {"token": "t" * 16},
            "dead_letters": {"table": "dlq"},
            "aws": aws,
        },
        env={},
    )


def test_stack_names_include_the_topic_and_stay_apart_after_sanitizing() -> None:
    dotted = stack_name(_settings("orders.eu"))
    underscored = stack_name(_settings("orders_eu"))
    assert dotted.startswith("triage-orders-eu-g-")
    assert dotted != underscored
    assert stack_name(_settings("plain", "grp")) == "triage-plain-grp"
    assert stack_name(_settings("x", stack_name="mine")) == "mine"
    for name in (dotted, underscored, stack_name(_settings("t" * 249))):
        assert re.fullmatch(r"[A-Za-z][A-Za-z0-9-]{0,127}", name)


def test_aws_settings_are_validated_and_name_the_key() -> None:
    with pytest.raises(ConfigError) as bad_scheme:
        _settings("t", scheme="public")
    assert bad_scheme.value.key == "aws.scheme"
    with pytest.raises(ConfigError) as unknown:
        _settings("t", region="eu-west-1")
    assert unknown.value.key == "aws.region"
    with pytest.raises(ConfigError) as wrong_type:
        _settings("t", subnet_ids="subnet-1")
    assert wrong_type.value.key == "aws.subnet_ids"
    assert _settings("t", subnet_ids=["subnet-1", "subnet-2"]).aws.subnet_ids == (
        "subnet-1",
        "subnet-2",
    )


def test_execution_role_may_pull_only_from_the_images_ecr_repository() -> None:
    assert (
        _repository_arn("123456789012.dkr.ecr.eu-west-1.amazonaws.com/team/triage:1.2")
        == "arn:aws:ecr:eu-west-1:123456789012:repository/team/triage"
    )
    assert (
        _repository_arn("123456789012.dkr.ecr.eu-west-1.amazonaws.com/triage@sha256:ab")
        == "arn:aws:ecr:eu-west-1:123456789012:repository/triage"
    )
    assert _repository_arn("ghcr.io/acme/triage:1") == "*"
