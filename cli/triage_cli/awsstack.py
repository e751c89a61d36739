"""The CloudFormation template of an AWS deployment: one ECS service running a proxy fleet.

Layout (B = server.port, H = server.http_port):

    consumers --TCP :B--> NLB (one listener, passthrough: the bootstrap for Topology)
        --TCP--> any task of Service (DesiredCount = Proxies; each task is a fleet member,
                 `triage proxy` without --partition, advertising its own private DNS name
                 or IP:B, so Topology answers with every task's own address)
    consumers --TLS :B--> each task directly, inside the VPC (as a Kafka client reaches
                 each broker): TLS runs from the client to the task that serves it
    TaskDefinition: TRIAGE_CONFIG (the containers' triage.toml); Secrets TRIAGE_TLS_CERT,
              TRIAGE_TLS_KEY, TRIAGE_TLS_CLIENT_CA (Secrets Manager, injected by ECS with
              the execution role; infra/entrypoint.sh writes them to private files)
    LoadBalancerSecurityGroup: B from ClientCidr in, B to the proxies out
    ProxySecurityGroup: B from the NLB's group and from ClientCidr; H (/status, /metrics)
              from the VPC's CIDR only (the HTTP endpoint has no token)
    TaskRole: DynamoDB on the dead-letter table, S3 on the overflow bucket, SNS publish
              on the topic, GetSecretValue on the named secrets -- nothing else.
    ExecutionRole: pull the image, write to the log group, read the TLS secrets.

Why an NLB with one TCP listener: the load balancer only has to bring a consumer to
*some* task, which answers Topology from the lease items; the consumer then dials each
partition's task itself. Passthrough keeps TLS end to end, so `[tls]` (and mTLS with
`tls.client_ca_file`) hold on AWS as they do locally.

Why still rendered from Python rather than a static file: the ports, the optional HTTP
endpoint and the optional client CA shape the template. `infra/triage.yaml` is this
module's output with the default ports, kept as a readable reference (a test fails when
it is stale; `python -m triage_cli.awsstack` rewrites it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

CONTAINER_NAME = "triage"
STOP_TIMEOUT_S = 120
"""Fargate's maximum: SIGTERM lets in-flight work drain (shutdown.drain_timeout_s)."""
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096)
SERVICE_NAME = "proxies"
REFERENCE_PORT = 7700
REFERENCE_HTTP_PORT = 9700
REFERENCE_PATH = Path(__file__).resolve().parents[2] / "infra" / "triage.yaml"

_DYNAMODB_ACTIONS = [
    "dynamodb:BatchGetItem",
    "dynamodb:BatchWriteItem",
    "dynamodb:ConditionCheckItem",
    "dynamodb:DeleteItem",
    "dynamodb:DescribeTable",
    "dynamodb:GetItem",
    "dynamodb:PutItem",
    "dynamodb:Query",
    "dynamodb:UpdateItem",
]
"""What the proxy does to its table: batched dead-letter writes, checkpoint items,
the ownership lease (conditional put/update/delete). No Scan, no table admin."""


def _sub(text: str) -> dict[str, str]:
    return {"Fn::Sub": text}


def _ref(name: str) -> dict[str, str]:
    return {"Ref": name}


def _getatt(resource: str, attribute: str) -> dict[str, list[str]]:
    return {"Fn::GetAtt": [resource, attribute]}


def _assume(service: str) -> dict[str, Any]:
    return {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}
        ],
    }


def _parameters(http_port: int | None) -> dict[str, Any]:
    found: dict[str, Any] = {
        "Image": {"Type": "String", "Description": "Container image built from infra/Dockerfile"},
        "Proxies": {
            "Type": "Number",
            "MinValue": 1,
            "Description": "Fleet tasks; the consumer group spreads the partitions over them",
        },
        "VpcId": {"Type": "AWS::EC2::VPC::Id"},
        "SubnetIds": {"Type": "List<AWS::EC2::Subnet::Id>"},
        "Scheme": {
            "Type": "String",
            "Default": "internal",
            "AllowedValues": ["internal", "internet-facing"],
        },
        "ClientCidr": {
            "Type": "String",
            "Default": "0.0.0.0/0",
            "Description": "Addresses allowed to reach the listener and the tasks' gRPC port",
        },
        "AssignPublicIp": {
            "Type": "String",
            "Default": "DISABLED",
            "AllowedValues": ["ENABLED", "DISABLED"],
        },
        "Cpu": {"Type": "String", "Default": "512"},
        "Memory": {"Type": "String", "Default": "1024"},
        "LogRetentionDays": {
            "Type": "Number",
            "Default": 30,
            "AllowedValues": list(LOG_RETENTION_DAYS),
        },
        "TriageConfig": {
            "Type": "String",
            "Description": "triage.toml for the containers: secrets only as secret:NAME",
        },
        "TableName": {"Type": "String", "Description": "The DynamoDB dead-letter table"},
        "OverflowBucket": {"Type": "String", "Default": "", "Description": "'' for none"},
        "NotifyTopicArn": {"Type": "String", "Default": "", "Description": "'' for none"},
        "SecretArns": {
            "Type": "CommaDelimitedList",
            "Description": "Secrets the proxies may read (tokens, Kafka password)",
        },
        "TlsCertSecretArn": {
            "Type": "String",
            "Description": "Secret holding the PEM certificate chain the tasks present",
        },
        "TlsKeySecretArn": {
            "Type": "String",
            "Description": "Secret holding the PEM private key of that certificate",
        },
        "TlsClientCaSecretArn": {
            "Type": "String",
            "Default": "",
            "Description": "Secret holding the PEM CA of client certificates (mTLS); '' for none",
        },
        "CreateListener": {
            "Type": "String",
            "Default": "true",
            "AllowedValues": ["true", "false"],
            "Description": "false only where CloudFormation cannot make an NLB listener (moto)",
        },
        "ImageRepositoryArn": {
            "Type": "String",
            "Default": "*",
            "Description": "ECR repository of the image ('*' when not in ECR)",
        },
    }
    if http_port is not None:
        found["VpcCidr"] = {
            "Type": "String",
            "Description": "The VPC's CIDR: who may reach the HTTP endpoint (/status, /metrics)",
        }
    return found


def _roles() -> dict[str, Any]:
    table_arn = _sub(
        "arn:${AWS::Partition}:dynamodb:${AWS::Region}:${AWS::AccountId}:table/${TableName}"
    )
    task_statements: list[Any] = [
        {"Effect": "Allow", "Action": _DYNAMODB_ACTIONS, "Resource": table_arn},
        {
            "Fn::If": [
                "HasBucket",
                {
                    "Effect": "Allow",
                    "Action": ["s3:GetObject", "s3:PutObject"],
                    "Resource": _sub("arn:${AWS::Partition}:s3:::${OverflowBucket}/*"),
                },
                _ref("AWS::NoValue"),
            ]
        },
        {
            "Fn::If": [
                "HasTopic",
                {"Effect": "Allow", "Action": "sns:Publish", "Resource": _ref("NotifyTopicArn")},
                _ref("AWS::NoValue"),
            ]
        },
        {
            "Effect": "Allow",
            "Action": "secretsmanager:GetSecretValue",
            "Resource": _ref("SecretArns"),
        },
    ]
    return {
        "TaskRole": {
            "Type": "AWS::IAM::Role",
            "Properties": {
                "AssumeRolePolicyDocument": _assume("ecs-tasks.amazonaws.com"),
                "Policies": [
                    {
                        "PolicyName": "triage-proxy",
                        "PolicyDocument": {"Version": "2012-10-17", "Statement": task_statements},
                    }
                ],
            },
        },
        "ExecutionRole": {
            "Type": "AWS::IAM::Role",
            "Properties": {
                "AssumeRolePolicyDocument": _assume("ecs-tasks.amazonaws.com"),
                "Policies": [
                    {
                        "PolicyName": "triage-pull-and-log",
                        "PolicyDocument": {
                            "Version": "2012-10-17",
                            "Statement": [
                                {
                                    "Effect": "Allow",
                                    "Action": "ecr:GetAuthorizationToken",
                                    "Resource": "*",  # this action has no resource scope
                                },
                                {
                                    "Effect": "Allow",
                                    "Action": [
                                        "ecr:BatchCheckLayerAvailability",
                                        "ecr:BatchGetImage",
                                        "ecr:GetDownloadUrlForLayer",
                                    ],
                                    "Resource": _ref("ImageRepositoryArn"),
                                },
                                {
                                    "Effect": "Allow",
                                    "Action": ["logs:CreateLogStream", "logs:PutLogEvents"],
                                    "Resource": _getatt("LogGroup", "Arn"),
                                },
                                {
                                    # ECS injects the TLS files' secrets with this role;
                                    # the task role (the proxy itself) never reads them
                                    "Effect": "Allow",
                                    "Action": "secretsmanager:GetSecretValue",
                                    "Resource": [
                                        _ref("TlsCertSecretArn"),
                                        _ref("TlsKeySecretArn"),
                                        {
                                            "Fn::If": [
                                                "HasClientCa",
                                                _ref("TlsClientCaSecretArn"),
                                                _ref("AWS::NoValue"),
                                            ]
                                        },
                                    ],
                                },
                            ],
                        },
                    }
                ],
            },
        },
    }


def _network(port: int, http_port: int | None) -> dict[str, Any]:
    resources: dict[str, Any] = {
        "LoadBalancerSecurityGroup": {
            "Type": "AWS::EC2::SecurityGroup",
            "Properties": {
                "GroupDescription": _sub("${AWS::StackName}: the bootstrap listener"),
                "VpcId": _ref("VpcId"),
                "SecurityGroupIngress": [
                    {
                        "IpProtocol": "tcp",
                        "FromPort": port,
                        "ToPort": port,
                        "CidrIp": _ref("ClientCidr"),
                    }
                ],
                "SecurityGroupEgress": [
                    {
                        "IpProtocol": "tcp",
                        "FromPort": port,
                        "ToPort": port,
                        "DestinationSecurityGroupId": _getatt("ProxySecurityGroup", "GroupId"),
                    }
                ],
            },
        },
        "ProxySecurityGroup": {
            "Type": "AWS::EC2::SecurityGroup",
            "Properties": {
                "GroupDescription": _sub(
                    "${AWS::StackName}: proxies, gRPC from the NLB and the clients"
                ),
                "VpcId": _ref("VpcId"),
                # out: Kafka, AWS APIs and the image registry, wherever they are
                "SecurityGroupEgress": [
                    {"IpProtocol": "-1", "CidrIp": "0.0.0.0/0"},
                ],
            },
        },
        "ProxyIngressFromLoadBalancer": {
            "Type": "AWS::EC2::SecurityGroupIngress",
            "Properties": {
                "GroupId": _getatt("ProxySecurityGroup", "GroupId"),
                "IpProtocol": "tcp",
                "FromPort": port,
                "ToPort": port,
                "SourceSecurityGroupId": _getatt("LoadBalancerSecurityGroup", "GroupId"),
            },
        },
        # Consumers dial the task that serves their partition (its advertised address).
        "ProxyIngressFromClients": {
            "Type": "AWS::EC2::SecurityGroupIngress",
            "Properties": {
                "GroupId": _getatt("ProxySecurityGroup", "GroupId"),
                "IpProtocol": "tcp",
                "FromPort": port,
                "ToPort": port,
                "CidrIp": _ref("ClientCidr"),
            },
        },
        "LoadBalancer": {
            "Type": "AWS::ElasticLoadBalancingV2::LoadBalancer",
            "Properties": {
                "Type": "network",
                "Scheme": _ref("Scheme"),
                "Subnets": _ref("SubnetIds"),
                "SecurityGroups": [_getatt("LoadBalancerSecurityGroup", "GroupId")],
            },
        },
    }
    if http_port is not None:
        # /status and /metrics have no token: only from inside the VPC (`triage status`
        # run there, a Prometheus in the VPC), never from ClientCidr at large.
        resources["ProxyIngressForMonitoring"] = {
            "Type": "AWS::EC2::SecurityGroupIngress",
            "Properties": {
                "GroupId": _getatt("ProxySecurityGroup", "GroupId"),
                "IpProtocol": "tcp",
                "FromPort": http_port,
                "ToPort": http_port,
                "CidrIp": _ref("VpcCidr"),
            },
        }
    return resources


def _fleet(port: int, http_port: int | None) -> dict[str, Any]:
    ports = [{"ContainerPort": port, "Protocol": "tcp"}]
    if http_port is not None:
        ports.append({"ContainerPort": http_port, "Protocol": "tcp"})
    secrets: list[Any] = [
        {"Name": "TRIAGE_TLS_CERT", "ValueFrom": _ref("TlsCertSecretArn")},
        {"Name": "TRIAGE_TLS_KEY", "ValueFrom": _ref("TlsKeySecretArn")},
        {
            "Fn::If": [
                "HasClientCa",
                {"Name": "TRIAGE_TLS_CLIENT_CA", "ValueFrom": _ref("TlsClientCaSecretArn")},
                _ref("AWS::NoValue"),
            ]
        },
    ]
    return {
        "TargetGroup": {
            "Type": "AWS::ElasticLoadBalancingV2::TargetGroup",
            "Properties": {
                "Protocol": "TCP",
                "Port": port,
                "TargetType": "ip",
                "VpcId": _ref("VpcId"),
                "HealthCheckProtocol": "TCP",
                "TargetGroupAttributes": [
                    # a stopping proxy drains within STOP_TIMEOUT_S; no need to wait 300 s
                    {"Key": "deregistration_delay.timeout_seconds", "Value": str(STOP_TIMEOUT_S)}
                ],
            },
        },
        "Listener": {
            "Type": "AWS::ElasticLoadBalancingV2::Listener",
            "Condition": "HasListener",
            "Properties": {
                "LoadBalancerArn": _ref("LoadBalancer"),
                # passthrough: TLS ends at the task, which holds the certificate
                "Protocol": "TCP",
                "Port": port,
                "DefaultActions": [{"Type": "forward", "TargetGroupArn": _ref("TargetGroup")}],
            },
        },
        # A Service cannot DependsOn a conditional resource, so it depends on this handle,
        # which refers to the listener only when there is one (the documented pattern).
        "ListenerReady": {
            "Type": "AWS::CloudFormation::WaitConditionHandle",
            "Metadata": {"Listener": {"Fn::If": ["HasListener", _ref("Listener"), "none"]}},
        },
        "TaskDefinition": {
            "Type": "AWS::ECS::TaskDefinition",
            "Properties": {
                "Family": _sub("${AWS::StackName}-proxy"),
                "RequiresCompatibilities": ["FARGATE"],
                "NetworkMode": "awsvpc",
                "Cpu": _ref("Cpu"),
                "Memory": _ref("Memory"),
                "RuntimePlatform": {
                    "OperatingSystemFamily": "LINUX",
                    "CpuArchitecture": "X86_64",
                },
                "ExecutionRoleArn": _getatt("ExecutionRole", "Arn"),
                "TaskRoleArn": _getatt("TaskRole", "Arn"),
                "ContainerDefinitions": [
                    {
                        "Name": CONTAINER_NAME,
                        "Image": _ref("Image"),
                        "Essential": True,
                        "StopTimeout": STOP_TIMEOUT_S,
                        "PortMappings": ports,
                        # No TRIAGE_PARTITION: every task joins the fleet. The config's
                        # server.advertised_host names a kind of address ("ecs-task-dns"),
                        # which each task resolves from its own metadata at start.
                        "Environment": [{"Name": "TRIAGE_CONFIG", "Value": _ref("TriageConfig")}],
                        "Secrets": secrets,
                        "LogConfiguration": {
                            "LogDriver": "awslogs",
                            "Options": {
                                "awslogs-group": _ref("LogGroup"),
                                "awslogs-region": _ref("AWS::Region"),
                                "awslogs-stream-prefix": "proxy",
                            },
                        },
                    }
                ],
            },
        },
        "Service": {
            "Type": "AWS::ECS::Service",
            "DependsOn": ["ListenerReady"],  # the target group must belong to the NLB first
            "Properties": {
                "Cluster": _ref("Cluster"),
                "ServiceName": SERVICE_NAME,
                "TaskDefinition": _ref("TaskDefinition"),
                "LaunchType": "FARGATE",
                "DesiredCount": _ref("Proxies"),
                # The partitions' DynamoDB leases are the fence, not the task count: a
                # rolling update may start new tasks before the old ones drain.
                "DeploymentConfiguration": {"MinimumHealthyPercent": 100, "MaximumPercent": 200},
                "HealthCheckGracePeriodSeconds": 60,
                "NetworkConfiguration": {
                    "AwsvpcConfiguration": {
                        "Subnets": _ref("SubnetIds"),
                        "SecurityGroups": [_getatt("ProxySecurityGroup", "GroupId")],
                        "AssignPublicIp": _ref("AssignPublicIp"),
                    }
                },
                "LoadBalancers": [
                    {
                        "ContainerName": CONTAINER_NAME,
                        "ContainerPort": port,
                        "TargetGroupArn": _ref("TargetGroup"),
                    }
                ],
            },
        },
    }


def template(port: int, http_port: int | None) -> dict[str, Any]:
    """The template as a dict: every task listens on `port` (gRPC) and `http_port` (the
    HTTP endpoint; None: off)."""
    for value in (port, http_port):
        if value is not None and not 1 <= value <= 65535:
            raise ValueError(f"{value} is not a port a load balancer can forward to")
    resources: dict[str, Any] = {
        "LogGroup": {
            "Type": "AWS::Logs::LogGroup",
            "DeletionPolicy": "Delete",
            "UpdateReplacePolicy": "Delete",
            "Properties": {
                "LogGroupName": _sub("/triage/${AWS::StackName}"),
                "RetentionInDays": _ref("LogRetentionDays"),
            },
        },
        "Cluster": {
            "Type": "AWS::ECS::Cluster",
            "Properties": {"ClusterName": _ref("AWS::StackName")},
        },
        **_roles(),
        **_network(port, http_port),
        **_fleet(port, http_port),
    }
    bootstrap = f"${{LoadBalancer.DNSName}}:{port}"
    outputs: dict[str, Any] = {
        "BootstrapEndpoint": {
            "Description": "host:port for Topology: consumers then dial each task directly",
            "Value": _sub(bootstrap),
        },
        "ConsumerEndpoint": {
            "Description": "Deprecated: the same as BootstrapEndpoint",
            "Value": _sub(bootstrap),
        },
        "LoadBalancerDns": {"Value": _getatt("LoadBalancer", "DNSName")},
        "ClusterName": {"Value": _ref("Cluster")},
        "ServiceName": {"Value": SERVICE_NAME},
        "LogGroupName": {"Value": _ref("LogGroup")},
    }
    return {
        "AWSTemplateFormatVersion": "2010-09-09",
        "Description": "Triage: a proxy fleet on ECS Fargate, bootstrapped through a TCP NLB",
        "Parameters": _parameters(http_port),
        "Conditions": {
            "HasBucket": {"Fn::Not": [{"Fn::Equals": [_ref("OverflowBucket"), ""]}]},
            "HasTopic": {"Fn::Not": [{"Fn::Equals": [_ref("NotifyTopicArn"), ""]}]},
            "HasClientCa": {"Fn::Not": [{"Fn::Equals": [_ref("TlsClientCaSecretArn"), ""]}]},
            "HasListener": {"Fn::Equals": [_ref("CreateListener"), "true"]},
        },
        "Resources": resources,
        "Outputs": outputs,
    }


def render(port: int, http_port: int | None) -> str:
    """The template as YAML (long-form intrinsics, so any YAML parser reads it)."""
    header = (
        "# Generated by `python -m triage_cli.awsstack` (cli/triage_cli/awsstack.py); "
        "edit that, not this.\n"
    )
    return header + yaml.safe_dump(template(port, http_port), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> None:
    """Write the reference template (or one for other ports) to infra/triage.yaml."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--port", type=int, default=REFERENCE_PORT)
    parser.add_argument("--http-port", type=int, default=REFERENCE_HTTP_PORT, help="0: off")
    parser.add_argument("--out", type=Path, default=REFERENCE_PATH)
    args = parser.parse_args(argv)
    text = render(args.port, args.http_port or None)
    if str(args.out) == "-":
        sys.stdout.write(text)
    else:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
