"""The generated CloudFormation template: cfn-lint clean, one fleet service behind one TCP
(passthrough) listener, TLS files as task-definition secrets, least-privilege policies, and
the committed reference copy is fresh."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from triage_cli.aws import _repository_arn, stack_name
from triage_cli.awsstack import (
    REFERENCE_HTTP_PORT,
    REFERENCE_PATH,
    REFERENCE_PORT,
    SERVICE_NAME,
    render,
    template,
)
from triage_proxy.config.loader import settings_from_dict
from triage_proxy.errors import ConfigError


def lint_errors(text: str) -> list[str]:
    # Imported here, not at the top: cfn-lint imports sympy and networkx, 1.3 s of CPU that
    # every xdist worker paid while collecting; only the worker running these tests pays it.
    from cfnlint.api import ManualArgs, lint

    return [str(m) for m in lint(text, config=ManualArgs(regions=["us-east-1"]))]


# One worker imports cfn-lint for the three tests that lint.
@pytest.mark.xdist_group("cfn-lint")
@pytest.mark.parametrize("http_port", [9700, None])
def test_rendered_template_passes_cfn_lint(http_port: int | None) -> None:
    assert lint_errors(render(7700, http_port)) == []


@pytest.mark.xdist_group("cfn-lint")
def test_cfn_lint_does_catch_a_broken_template() -> None:
    broken = render(7700, 9700).replace("Protocol: TCP\n", "Protocol: TLZ\n")
    assert broken != render(7700, 9700)
    assert any("TLZ" in e for e in lint_errors(broken))


def test_reference_template_in_infra_is_fresh() -> None:
    assert REFERENCE_PATH.read_text() == render(REFERENCE_PORT, REFERENCE_HTTP_PORT), (
        "infra/triage.yaml is stale: run `.venv/bin/python -m triage_cli.awsstack`"
    )


def test_one_fleet_service_behind_one_tcp_listener() -> None:
    resources = template(9000, 9100)["Resources"]
    services = [name for name, r in resources.items() if r["Type"] == "AWS::ECS::Service"]
    assert services == ["Service"]  # no per-partition services
    service = resources["Service"]["Properties"]
    assert service["DesiredCount"] == {"Ref": "Proxies"}
    assert service["ServiceName"] == SERVICE_NAME
    assert service["LoadBalancers"][0]["ContainerPort"] == 9000
    listeners = [r for r in resources.values() if r["Type"].endswith("::Listener")]
    assert len(listeners) == 1
    listener = resources["Listener"]["Properties"]
    # passthrough: no certificate at the load balancer, TLS ends at the task
    assert (listener["Protocol"], listener["Port"]) == ("TCP", 9000)
    assert "Certificates" not in listener
    assert resources["TargetGroup"]["Properties"]["Port"] == 9000
    container = resources["TaskDefinition"]["Properties"]["ContainerDefinitions"][0]
    assert container["PortMappings"] == [
        {"ContainerPort": 9000, "Protocol": "tcp"},
        {"ContainerPort": 9100, "Protocol": "tcp"},
    ]
    names = [e["Name"] for e in container["Environment"]]
    assert names == ["TRIAGE_CONFIG"]  # no TRIAGE_PARTITION, no advertised host
    secrets = {}
    for entry in container["Secrets"]:
        if "Fn::If" in entry:
            assert entry["Fn::If"][0] == "HasClientCa"
            entry = entry["Fn::If"][1]
        secrets[entry["Name"]] = entry["ValueFrom"]
    assert secrets == {
        "TRIAGE_TLS_CERT": {"Ref": "TlsCertSecretArn"},
        "TRIAGE_TLS_KEY": {"Ref": "TlsKeySecretArn"},
        "TRIAGE_TLS_CLIENT_CA": {"Ref": "TlsClientCaSecretArn"},
    }


def test_security_groups_open_grpc_to_clients_and_http_to_the_vpc_only() -> None:
    resources = template(9000, 9100)["Resources"]
    lb_in = resources["LoadBalancerSecurityGroup"]["Properties"]["SecurityGroupIngress"]
    assert [(r["FromPort"], r["ToPort"], r["CidrIp"]) for r in lb_in] == [
        (9000, 9000, {"Ref": "ClientCidr"})
    ]
    assert "SecurityGroupIngress" not in resources["ProxySecurityGroup"]["Properties"]
    rules = {
        name: r["Properties"]
        for name, r in resources.items()
        if r["Type"] == "AWS::EC2::SecurityGroupIngress"
    }
    assert {n: (r["FromPort"], r["ToPort"]) for n, r in rules.items()} == {
        "ProxyIngressFromLoadBalancer": (9000, 9000),
        "ProxyIngressFromClients": (9000, 9000),
        "ProxyIngressForMonitoring": (9100, 9100),
    }
    assert rules["ProxyIngressFromLoadBalancer"]["SourceSecurityGroupId"] == {
        "Fn::GetAtt": ["LoadBalancerSecurityGroup", "GroupId"]
    }
    assert rules["ProxyIngressFromClients"]["CidrIp"] == {"Ref": "ClientCidr"}
    assert rules["ProxyIngressForMonitoring"]["CidrIp"] == {"Ref": "VpcCidr"}
    # no HTTP endpoint: no port for it, no rule, no VpcCidr parameter
    quiet = template(9000, None)
    assert "ProxyIngressForMonitoring" not in quiet["Resources"]
    assert "VpcCidr" not in quiet["Parameters"]
    container = quiet["Resources"]["TaskDefinition"]["Properties"]["ContainerDefinitions"][0]
    assert container["PortMappings"] == [{"ContainerPort": 9000, "Protocol": "tcp"}]


def _statements(role: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for statement in role["Properties"]["Policies"][0]["PolicyDocument"]["Statement"]:
        if "Fn::If" in statement:
            statement = statement["Fn::If"][1]
        found.append(statement)
    return found


def test_roles_grant_no_wildcard_actions_or_resources_beyond_ecr_login() -> None:
    resources = template(7700, 9700)["Resources"]
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
    # The TLS secrets: read by ECS with the execution role, never by the proxy's task role.
    task_secrets = [
        s["Resource"]
        for s in _statements(resources["TaskRole"])
        if s["Action"] == "secretsmanager:GetSecretValue"
    ]
    assert task_secrets == [{"Ref": "SecretArns"}]
    (tls,) = [
        s["Resource"]
        for s in _statements(resources["ExecutionRole"])
        if s["Action"] == "secretsmanager:GetSecretValue"
    ]
    assert tls[:2] == [{"Ref": "TlsCertSecretArn"}, {"Ref": "TlsKeySecretArn"}]
    assert tls[2]["Fn::If"][:2] == ["HasClientCa", {"Ref": "TlsClientCaSecretArn"}]


def as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def test_template_parses_as_plain_yaml() -> None:
    parsed = yaml.safe_load(render(7700, 9700))
    assert set(parsed["Outputs"]) >= {"BootstrapEndpoint", "ConsumerEndpoint", "ServiceName"}
    assert not any(name.startswith("Partition") for name in parsed["Outputs"])


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


def test_aws_proxies_default_to_two_or_the_partition_count_and_are_bounded() -> None:
    assert _settings("t").aws.proxies is None
    assert [_settings("t").aws.fleet_size(p) for p in (1, 2, 3, 64)] == [1, 2, 2, 2]
    assert _settings("t", proxies=5).aws.fleet_size(3) == 5
    for bad in (0, 5001, True, 2.0):
        with pytest.raises(ConfigError) as caught:
            _settings("t", proxies=bad)
        assert caught.value.key == "aws.proxies"
