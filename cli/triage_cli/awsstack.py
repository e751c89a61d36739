"""The CloudFormation template of an AWS deployment, rendered for N partitions.

Why generated: CloudFormation has no loops, and a deployment needs one ECS service,
one target group and one TLS listener per partition (partition p on port base + p,
the same numbering as `server.port` locally). Rendering from Python keeps the
template exactly as large as the topic instead of a fixed maximum with Conditions.
`infra/triage.yaml` is this module's output for three partitions, kept as a readable
reference (a test fails when it is stale; `python -m triage_cli.awsstack` rewrites it).

Why a Network Load Balancer: every partition has its own proxy, so a consumer must
reach a *specific* one. gRPC calls to different proxies carry the same path, so an
ALB could only tell them apart by host name (one DNS name and certificate name per
partition). An NLB gives each partition its own port with a TLS listener (ALPN h2 for
gRPC) and forwards plain TCP to the task, with no idle-stream surprises.

Layout (P = partitions, B = base port):

    clients --TLS :B..B+P-1--> NLB (LoadBalancerSecurityGroup: only those ports in)
        --TCP--> ServiceP -> TaskDefinitionP (Fargate, `triage proxy --partition p`,
                 advertising <NLB DNS name>:B+p: TRIAGE_ADVERTISED_HOST)
                 (ProxySecurityGroup: only B..B+P-1 and only from the NLB's group)
    TaskRole: DynamoDB on the dead-letter table, S3 on the overflow bucket, SNS publish
              on the topic, GetSecretValue on the named secrets -- nothing else.
    ExecutionRole: pull the image, write to the log group.
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
TLS_POLICY = "ELBSecurityPolicy-TLS13-1-2-2021-06"
LOG_RETENTION_DAYS = (1, 3, 5, 7, 14, 30, 60, 90, 120, 150, 180, 365, 400, 545, 731, 1096)
REFERENCE_PARTITIONS = 3
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


def _parameters() -> dict[str, Any]:
    return {
        "Image": {"Type": "String", "Description": "Container image built from infra/Dockerfile"},
        "CertificateArn": {
            "Type": "String",
            "AllowedPattern": "arn:aws[a-z-]*:acm:.+",
            "Description": "ACM certificate the TLS listeners present",
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
            "Description": "Addresses allowed to reach the listener ports",
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
        "TlsListeners": {
            "Type": "String",
            "Default": "true",
            "AllowedValues": ["true", "false"],
            "Description": "false only where CloudFormation cannot make NLB TLS listeners (moto)",
        },
        "ImageRepositoryArn": {
            "Type": "String",
            "Default": "*",
            "Description": "ECR repository of the image ('*' when not in ECR)",
        },
    }


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
                            ],
                        },
                    }
                ],
            },
        },
    }


def _network(partitions: int, base_port: int) -> dict[str, Any]:
    last = base_port + partitions - 1
    return {
        "LoadBalancerSecurityGroup": {
            "Type": "AWS::EC2::SecurityGroup",
            "Properties": {
                "GroupDescription": _sub(
                    "${AWS::StackName}: TLS listeners, one port per partition"
                ),
                "VpcId": _ref("VpcId"),
                "SecurityGroupIngress": [
                    {
                        "IpProtocol": "tcp",
                        "FromPort": base_port,
                        "ToPort": last,
                        "CidrIp": _ref("ClientCidr"),
                    }
                ],
                "SecurityGroupEgress": [
                    {
                        "IpProtocol": "tcp",
                        "FromPort": base_port,
                        "ToPort": last,
                        "DestinationSecurityGroupId": _getatt("ProxySecurityGroup", "GroupId"),
                    }
                ],
            },
        },
        "ProxySecurityGroup": {
            "Type": "AWS::EC2::SecurityGroup",
            "Properties": {
                "GroupDescription": _sub("${AWS::StackName}: proxies, reachable from the NLB only"),
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
                "FromPort": base_port,
                "ToPort": last,
                "SourceSecurityGroupId": _getatt("LoadBalancerSecurityGroup", "GroupId"),
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


def _partition(p: int, base_port: int) -> dict[str, Any]:
    port = base_port + p
    return {
        f"TargetGroup{p}": {
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
        f"Listener{p}": {
            "Type": "AWS::ElasticLoadBalancingV2::Listener",
            "Condition": "HasListeners",
            "Properties": {
                "LoadBalancerArn": _ref("LoadBalancer"),
                "Protocol": "TLS",
                "Port": port,
                "Certificates": [{"CertificateArn": _ref("CertificateArn")}],
                "SslPolicy": TLS_POLICY,
                "AlpnPolicy": ["HTTP2Only"],  # gRPC clients insist on h2 over ALPN
                "DefaultActions": [{"Type": "forward", "TargetGroupArn": _ref(f"TargetGroup{p}")}],
            },
        },
        # A Service cannot DependsOn a conditional resource, so it depends on this handle,
        # which refers to the listener only when there is one (the documented pattern).
        f"Listener{p}Ready": {
            "Type": "AWS::CloudFormation::WaitConditionHandle",
            "Metadata": {"Listener": {"Fn::If": ["HasListeners", _ref(f"Listener{p}"), "none"]}},
        },
        f"TaskDefinition{p}": {
            "Type": "AWS::ECS::TaskDefinition",
            "Properties": {
                "Family": _sub(f"${{AWS::StackName}}-partition-{p}"),
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
                        "PortMappings": [{"ContainerPort": port, "Protocol": "tcp"}],
                        "Environment": [
                            {"Name": "TRIAGE_CONFIG", "Value": _ref("TriageConfig")},
                            {"Name": "TRIAGE_PARTITION", "Value": str(p)},
                            # What consumers dial (the lease item, Topology): the NLB's
                            # name; its listener port is the container's, the default.
                            {
                                "Name": "TRIAGE_ADVERTISED_HOST",
                                "Value": _getatt("LoadBalancer", "DNSName"),
                            },
                        ],
                        "LogConfiguration": {
                            "LogDriver": "awslogs",
                            "Options": {
                                "awslogs-group": _ref("LogGroup"),
                                "awslogs-region": _ref("AWS::Region"),
                                "awslogs-stream-prefix": f"partition-{p}",
                            },
                        },
                    }
                ],
            },
        },
        f"Service{p}": {
            "Type": "AWS::ECS::Service",
            "DependsOn": [f"Listener{p}Ready"],  # the target group must belong to the NLB first
            "Properties": {
                "Cluster": _ref("Cluster"),
                "ServiceName": f"partition-{p}",
                "TaskDefinition": _ref(f"TaskDefinition{p}"),
                "LaunchType": "FARGATE",
                "DesiredCount": 1,
                # one owner per partition: stop the old task before starting the new one
                "DeploymentConfiguration": {"MinimumHealthyPercent": 0, "MaximumPercent": 100},
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
                        "TargetGroupArn": _ref(f"TargetGroup{p}"),
                    }
                ],
            },
        },
    }


def template(partitions: int, base_port: int) -> dict[str, Any]:
    """The template as a dict: every partition p in [0, partitions) on base_port + p."""
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    if not base_port >= 1 or base_port + partitions - 1 > 65535:
        raise ValueError(f"ports {base_port}..{base_port + partitions - 1} are not all valid")
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
        **_network(partitions, base_port),
    }
    outputs: dict[str, Any] = {
        "ConsumerEndpoint": {
            "Description": f"host:port of partition 0; partition p listens on port {base_port} + p",
            "Value": _sub(f"${{LoadBalancer.DNSName}}:{base_port}"),
        },
        "LoadBalancerDns": {"Value": _getatt("LoadBalancer", "DNSName")},
        "ClusterName": {"Value": _ref("Cluster")},
        "LogGroupName": {"Value": _ref("LogGroup")},
    }
    for p in range(partitions):
        resources.update(_partition(p, base_port))
        outputs[f"Partition{p}Endpoint"] = {
            "Value": _sub(f"${{LoadBalancer.DNSName}}:{base_port + p}")
        }
    return {
        "AWSTemplateFormatVersion": "2010-09-09",
        "Description": f"Triage: {partitions} partition proxies on ECS Fargate behind a TLS NLB",
        "Parameters": _parameters(),
        "Conditions": {
            "HasBucket": {"Fn::Not": [{"Fn::Equals": [_ref("OverflowBucket"), ""]}]},
            "HasTopic": {"Fn::Not": [{"Fn::Equals": [_ref("NotifyTopicArn"), ""]}]},
            "HasListeners": {"Fn::Equals": [_ref("TlsListeners"), "true"]},
        },
        "Resources": resources,
        "Outputs": outputs,
    }


def render(partitions: int, base_port: int) -> str:
    """The template as YAML (long-form intrinsics, so any YAML parser reads it)."""
    header = (
        "# Generated by `python -m triage_cli.awsstack` (cli/triage_cli/awsstack.py); "
        "edit that, not this.\n"
    )
    return header + yaml.safe_dump(template(partitions, base_port), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> None:
    """Write the reference template (or one for --partitions) to infra/triage.yaml."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--partitions", type=int, default=REFERENCE_PARTITIONS)
    parser.add_argument("--base-port", type=int, default=7700)
    parser.add_argument("--out", type=Path, default=REFERENCE_PATH)
    args = parser.parse_args(argv)
    text = render(args.partitions, args.base_port)
    if str(args.out) == "-":
        sys.stdout.write(text)
    else:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
