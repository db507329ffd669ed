"""Deploys infra/template.yaml into the moto server's CloudFormation and checks what it made.

The SAM template is translated to plain CloudFormation with samtranslator (what
`sam deploy` does on AWS's side), the functions' code is a placeholder zip in moto's S3
(moto creates functions without running them), and the stack is created with the
parameters a user would give. Then the resources are read back through their own
services: the functions' reserved concurrency, runtime and wiring, the schedule, the
queues' redrive policy and encryption, the table's key and billing (on demand, and in a
second stack with `TableCapacity=provisioned`, by capacity with auto scaling), the outputs. What
moto's CloudFormation does not create (alarms, async invoke configs, architectures) is
checked as the translated template declares it.

Given the `paceline` binary, an operator's commands are run against the deployed stack
by its name: `paceline lanes` reads the lanes the orchestrator is deployed with and
keeps a lane's change in the stack's table.

Usage: deploy_to_moto.py TEMPLATE MOTO_URL [PACELINE_BIN]
"""

import ast
import copy
import io
import json
import os
import subprocess
import sys
import uuid
import zipfile

import boto3
from samtranslator.translator.transform import transform
from samtranslator.yaml_helper import yaml_parse


class NoManagedPolicies:
    """The template names no managed policies by name, so nothing needs looking up."""

    def load(self):
        return {}


def client(service, url):
    return boto3.client(service, endpoint_url=url, region_name="us-east-1", aws_access_key_id="test", aws_secret_access_key="test")


def check(condition, what):
    if not condition:
        raise AssertionError(what)
    print(f"  ok  {what}")


# Two lanes' defaults and one named lane, as the Lanes parameter takes them.
LANES = '{"tiers": ["5/s"], "headers": {"Authorization": {"env": "API_TOKEN_{lane}", "prefix": "Bearer "}}, "gold": {"tiers": ["20/s"], "weight": 3}}'


def main(template_path, url):
    with open(template_path) as f:
        template = yaml_parse(f.read())

    unique = uuid.uuid4().hex[:8]
    bucket = f"paceline-code-{unique}"
    s3 = client("s3", url)
    s3.create_bucket(Bucket=bucket)
    code = io.BytesIO()
    with zipfile.ZipFile(code, "w") as z:
        z.writestr("bootstrap", "#!/bin/sh\n")
    s3.put_object(Bucket=bucket, Key="lambda.zip", Body=code.getvalue())
    for name in ("OrchestratorFunction", "WorkerFunction"):
        template["Resources"][name]["Properties"]["CodeUri"] = {"Bucket": bucket, "Key": "lambda.zip"}

    secret_arn = client("secretsmanager", url).create_secret(Name=f"paceline-api-token-{unique}", SecretString="s3cr3t")["ARN"]
    parameters = {
        "ApiBaseUrl": "https://api.example.com/v1",
        "QuotaTiers": "10/s,500/min,100000/day",
        "ApiSecretArn": secret_arn,
        "MaxReceiveCount": "4",
        "Lanes": LANES,
        "LaneSecretPrefix": "paceline/keys/",
    }
    # The translator fills in pseudo parameters (AWS::Region...) from a boto3 session.
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    check_provisioned_table(template, url, dict(parameters), f"paceline-provisioned-{unique}")
    sharded = check_sharded_stack(template, url, dict(parameters), f"paceline-sharded-{unique}")
    translated = transform(copy.deepcopy(template), dict(parameters), NoManagedPolicies())

    cfn = client("cloudformation", url)
    stack = f"paceline-{unique}"
    described = create_stack(cfn, stack, translated, parameters)
    outputs = {o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])}
    resources = {r.get("LogicalResourceId"): r.get("PhysicalResourceId") for r in cfn.describe_stack_resources(StackName=stack)["StackResources"]}

    lam = client("lambda", url)
    orchestrator = outputs["OrchestratorFunctionName"]
    worker = outputs["WorkerFunctionName"]
    check(lam.get_function_concurrency(FunctionName=orchestrator).get("ReservedConcurrentExecutions") == 2, "orchestrator: reserved concurrency 2 (a run and its relay)")
    orchestrator_arn = lam.get_function(FunctionName=orchestrator)["Configuration"]["FunctionArn"]
    iam = client("iam", url)
    role = lam.get_function_configuration(FunctionName=orchestrator)["Role"].split("/")[-1]
    relay = iam.get_role_policy(RoleName=role, PolicyName="orchestrator-relay")["PolicyDocument"]
    relay = json.loads(relay) if isinstance(relay, str) else relay
    check(relay["Statement"] == [{"Effect": "Allow", "Action": "lambda:InvokeFunction", "Resource": orchestrator_arn}], "orchestrator: may invoke itself (its relay), nothing more")
    config = lam.get_function_configuration(FunctionName=orchestrator)
    check(config["Runtime"] == "provided.al2023" and config["Handler"] == "bootstrap" and config["MemorySize"] == 128, "orchestrator: provided.al2023, 128 MB")
    check(config["Timeout"] == 70, "orchestrator: timeout from OrchestratorTimeoutSeconds")
    env = config["Environment"]["Variables"]
    check(env["PACELINE_WORKER_FUNCTION"] == worker and env["PACELINE_QUEUE_URL"] == outputs["JobsQueueUrl"], "orchestrator: wired to the worker and the queue")
    check(env["PACELINE_VISIBILITY_TIMEOUT"] == "70s" and env["PACELINE_DEADLINE_MARGIN"] == "5s", "orchestrator: run budget below the timeout, visibility covers a run")
    check(env["PACELINE_RELAY"] == "on", "orchestrator: each run starts its relay")
    worker_env = lam.get_function_configuration(FunctionName=worker)["Environment"]["Variables"]
    check("s3cr3t" not in json.dumps(worker_env), "worker: the secret is not in its configuration")
    check(
        json.loads(worker_env["PACELINE_API_SECRETS"]) == {"API_TOKEN": secret_arn, "API_TOKEN_{lane}": "paceline/keys/{lane}"},
        "worker: reads the token, and each lane's own, from Secrets Manager",
    )
    check(env["PACELINE_LANES"] == LANES and worker_env["PACELINE_LANES"] == LANES, "both functions: the stack's lanes")
    check(env["PACELINE_TIERS"] == worker_env["PACELINE_TIERS"] == "10/s,500/min,100000/day", "both functions: the quota the lanes share")
    worker_role = lam.get_function_configuration(FunctionName=worker)["Role"].split("/")[-1]
    documents = [iam.get_role_policy(RoleName=worker_role, PolicyName=name)["PolicyDocument"] for name in iam.list_role_policies(RoleName=worker_role)["PolicyNames"]]
    # moto keeps a role's inline policies as the Python text of their documents, a
    # statement left out by a condition as None.
    documents = [ast.literal_eval(d) if isinstance(d, str) else d for d in documents]
    readable = [s["Resource"] for d in documents for s in d["Statement"] if s and s["Action"] == "secretsmanager:GetSecretValue"]
    check(
        sorted(readable) == sorted([secret_arn, "arn:aws:secretsmanager:us-east-1:123456789012:secret:paceline/keys/*"]),
        f"worker role: may read the token and the lanes' secrets under their prefix, no other: {readable}",
    )

    sqs = client("sqs", url)
    events = client("events", url)
    rule = resources["OrchestratorFunctionEveryMinute"].split("/")[-1]
    check(events.describe_rule(Name=rule).get("ScheduleExpression") == "rate(1 minute)", "a rate(1 minute) schedule")
    targets = events.list_targets_by_rule(Rule=rule)["Targets"]
    check(any(t["Arn"].endswith(f":function:{orchestrator}") for t in targets), "the schedule kicks the orchestrator")

    attributes = sqs.get_queue_attributes(QueueUrl=outputs["JobsQueueUrl"], AttributeNames=["All"])["Attributes"]
    redrive = json.loads(attributes["RedrivePolicy"])
    dlq_arn = sqs.get_queue_attributes(QueueUrl=outputs["JobsDlqUrl"], AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    check(redrive["deadLetterTargetArn"] == dlq_arn and int(redrive["maxReceiveCount"]) == 4, "jobs queue: redrive to the jobs DLQ after MaxReceiveCount receives")
    check(attributes.get("KmsMasterKeyId") == "alias/aws/sqs", "jobs queue: encrypted at rest")
    results = sqs.get_queue_attributes(QueueUrl=outputs["ResultsQueueUrl"], AttributeNames=["All"])["Attributes"]
    check(results.get("KmsMasterKeyId") == "alias/aws/sqs", "results queue: made by the stack, encrypted at rest")
    check(worker_env["PACELINE_OUTCOMES"] == "final" and str(worker_env["PACELINE_OUTCOME_MAX_BODY"]) == "65536", "worker: records each job's outcome, body capped")

    table = client("dynamodb", url).describe_table(TableName=outputs["StateTableName"])["Table"]
    check(table["KeySchema"] == [{"AttributeName": "pk", "KeyType": "HASH"}], "table: string partition key pk")
    check(table["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST", "table: on demand")

    check("[backend]" in outputs["PacelineBackend"] and outputs["JobsQueueUrl"] in outputs["PacelineBackend"], "outputs: a [backend] section for the CLI")
    check("Dashboard" in resources, "a dashboard")
    check_what_moto_cannot_create(translated)
    print("the template deploys with the expected settings")
    return stack, sharded


def create_stack(cfn, stack, translated, parameters):
    """Creates `stack` from the translated template; returns its description."""
    cfn.create_stack(
        StackName=stack,
        TemplateBody=json.dumps(translated),
        Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in parameters.items()],
        Capabilities=["CAPABILITY_IAM", "CAPABILITY_AUTO_EXPAND"],
    )
    described = cfn.describe_stacks(StackName=stack)["Stacks"][0]
    print(f"stack {stack}: {described['StackStatus']}")
    check(described["StackStatus"] == "CREATE_COMPLETE", "the stack was created")
    return described


def check_provisioned_table(template, url, parameters, stack):
    """TableCapacity=provisioned: the table is provisioned at its least capacities, and
    auto scaling keeps each of them at 70% use between the least and the most."""
    parameters.update(TableCapacity="provisioned", TableMinWriteCapacity="30", TableMaxWriteCapacity="1500", TableMinReadCapacity="5", TableMaxReadCapacity="400")
    translated = transform(copy.deepcopy(template), dict(parameters), NoManagedPolicies())
    described = create_stack(client("cloudformation", url), stack, translated, parameters)
    outputs = {o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])}
    table = client("dynamodb", url).describe_table(TableName=outputs["StateTableName"])["Table"]
    throughput = table["ProvisionedThroughput"]
    check((throughput["WriteCapacityUnits"], throughput["ReadCapacityUnits"]) == (30, 5), "provisioned table: its least capacities to start with")
    check(table.get("BillingModeSummary", {}).get("BillingMode", "PROVISIONED") == "PROVISIONED", "provisioned table: billed by capacity")
    # moto's CloudFormation does not create auto scaling's targets and policies: they are
    # checked as the translated template declares them.
    targets = {
        t["ScalableDimension"]: (t["ServiceNamespace"], t["MinCapacity"], t["MaxCapacity"])
        for t in declared(translated, "AWS::ApplicationAutoScaling::ScalableTarget")
    }
    check(
        targets
        == {
            "dynamodb:table:WriteCapacityUnits": ("dynamodb", {"Ref": "TableMinWriteCapacity"}, {"Ref": "TableMaxWriteCapacity"}),
            "dynamodb:table:ReadCapacityUnits": ("dynamodb", {"Ref": "TableMinReadCapacity"}, {"Ref": "TableMaxReadCapacity"}),
        },
        "provisioned table: auto scaling between the least and the most capacities",
    )
    policies = declared(translated, "AWS::ApplicationAutoScaling::ScalingPolicy")
    tracked = sorted(p["TargetTrackingScalingPolicyConfiguration"]["PredefinedMetricSpecification"]["PredefinedMetricType"] for p in policies)
    check(tracked == ["DynamoDBReadCapacityUtilization", "DynamoDBWriteCapacityUtilization"], "provisioned table: writes and reads each tracked")
    check(all(p["TargetTrackingScalingPolicyConfiguration"]["TargetValue"] == 70 for p in policies), "provisioned table: kept at 70% use")


def check_sharded_stack(template, url, parameters, stack):
    """Shards=3: a jobs queue for each shard, all of them run by the one orchestrator
    function (a run and its relay each), which may receive from and pass jobs on to
    each; returns the stack's name."""
    parameters.update(Shards="3")
    translated = transform(copy.deepcopy(template), dict(parameters), NoManagedPolicies())
    described = create_stack(client("cloudformation", url), stack, translated, parameters)
    outputs = {o["OutputKey"]: o["OutputValue"] for o in described.get("Outputs", [])}
    queues = json.loads(outputs["ShardQueueUrls"])
    check(len(queues) == 3 and queues[0] == outputs["JobsQueueUrl"], "shards: a jobs queue for each of the three, shard 0's the stack's")
    sqs = client("sqs", url)
    dlq_arn = sqs.get_queue_attributes(QueueUrl=outputs["JobsDlqUrl"], AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    redrives = [json.loads(sqs.get_queue_attributes(QueueUrl=q, AttributeNames=["RedrivePolicy"])["Attributes"]["RedrivePolicy"]) for q in queues]
    check(all(r["deadLetterTargetArn"] == dlq_arn for r in redrives), "shards: every shard's queue redrives to the one jobs DLQ")
    lam = client("lambda", url)
    orchestrator = outputs["OrchestratorFunctionName"]
    check(lam.get_function_concurrency(FunctionName=orchestrator).get("ReservedConcurrentExecutions") == 6, "shards: one orchestrator function, a run and its relay for each shard")
    env = lam.get_function_configuration(FunctionName=orchestrator)["Environment"]["Variables"]
    check(json.loads(env["PACELINE_SHARD_QUEUES"]) == queues, "shards: the orchestrator runs each shard from its queue")
    arns = {sqs.get_queue_attributes(QueueUrl=q, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"] for q in queues}
    iam = client("iam", url)

    def statements(function):
        role = lam.get_function_configuration(FunctionName=function)["Role"].split("/")[-1]
        documents = [iam.get_role_policy(RoleName=role, PolicyName=name)["PolicyDocument"] for name in iam.list_role_policies(RoleName=role)["PolicyNames"]]
        documents = [ast.literal_eval(d) if isinstance(d, str) else d for d in documents]
        return [s for d in documents for s in d["Statement"] if s]

    def resources(statement):
        # moto keeps an entry a condition left out (AWS::NoValue) as None.
        listed = statement["Resource"] if isinstance(statement["Resource"], list) else [statement["Resource"]]
        return {r for r in listed if r}

    passing_on = [s for s in statements(orchestrator) if "sqs:SendMessage" in s["Action"] and "sqs:ReceiveMessage" in s["Action"]]
    check(len(passing_on) == 1 and resources(passing_on[0]) == arns, "shards: the orchestrator may receive from and pass jobs on to every shard's queue, no other")
    worker = outputs["WorkerFunctionName"]
    worker_env = lam.get_function_configuration(FunctionName=worker)["Environment"]["Variables"]
    check(json.loads(worker_env["PACELINE_SHARD_QUEUES"]) == queues, "shards: the worker knows each shard's queue")
    sends = set().union(*(resources(s) for s in statements(worker) if "sqs:SendMessage" in s["Action"]))
    check(arns <= sends, "shards: the worker may put a lane's job back on its shard's queue")
    # moto's CloudFormation does not create alarms: this one is checked as declared.
    alarm = translated["Resources"]["ShardsOldestJobAlarm"]
    watched = json.dumps(alarm["Properties"]["Metrics"])
    check(
        alarm["Condition"] == "Sharded" and "MAX(METRICS())" in watched and all(f"JobsQueueShard{k}" in watched for k in (1, 2, 3)),
        "shards: an alarm on the oldest job of the other shards' queues",
    )
    return stack


def declared(translated, resource_type):
    """The properties of each resource of a type in the translated template."""
    return [r["Properties"] for r in translated["Resources"].values() if r["Type"] == resource_type]


def check_what_moto_cannot_create(translated):
    """moto's CloudFormation skips alarms and async invoke configs and drops a function's
    architecture: these are checked as the translated template declares them."""
    print("declared in the translated template (moto's CloudFormation does not create these):")
    functions = declared(translated, "AWS::Lambda::Function")
    check(len(functions) == 2 and all(f["Architectures"] == ["arm64"] for f in functions), "both functions: arm64")
    check(
        all(f["LoggingConfig"]["LogFormat"] == "JSON" and f["LoggingConfig"]["ApplicationLogLevel"] == {"Ref": "LogLevel"} for f in functions)
        and all("RUST_LOG" not in f["Environment"]["Variables"] for f in functions),
        "both functions: JSON logs at the level of Lambda's logging configuration",
    )
    configs = declared(translated, "AWS::Lambda::EventInvokeConfig")
    kicks = [c for c in configs if c["MaximumRetryAttempts"] == 0]
    check(len(kicks) == 1 and kicks[0]["MaximumEventAgeInSeconds"] == 60, "orchestrator: kicks expire after 60 s, never retried")
    on_failure = [c["DestinationConfig"]["OnFailure"]["Destination"] for c in configs if "OnFailure" in c.get("DestinationConfig", {})]
    check(on_failure == [{"Fn::GetAtt": ["WorkerDlq", "Arn"]}], "worker: failed events go to the worker DLQ")
    on_success = [c["DestinationConfig"]["OnSuccess"] for c in configs if "OnSuccess" in c.get("DestinationConfig", {})]
    check(
        on_success == [{"Fn::If": ["RecordsOutcomes", {"Destination": {"Fn::If": ["UsesResultsQueue", {"Fn::GetAtt": ["ResultsQueue", "Arn"]}, {"Ref": "ResultsDestinationArn"}]}}, {"Ref": "AWS::NoValue"}]}],
        "worker: each job's outcome record (its function result) goes to the results queue, or the named destination",
    )
    grants = json.dumps(translated["Resources"]["WorkerFunctionRole"]["Properties"]["Policies"])
    check('"UsesResultsQueue", {"Effect": "Allow", "Action": "sqs:SendMessage", "Resource": {"Fn::GetAtt": ["ResultsQueue", "Arn"]}}' in grants, "worker role: may send to the results queue only")
    check('"ResultsToSns", {"Effect": "Allow", "Action": "sns:Publish", "Resource": {"Ref": "ResultsDestinationArn"}}' in grants, "worker role: may publish to a named topic only")
    alarms = {a.get("MetricName") for a in declared(translated, "AWS::CloudWatch::Alarm")}
    check(
        {"ApproximateNumberOfMessagesVisible", "CircuitOpen", "QuotaExhausted", "Errors", "ApproximateAgeOfOldestMessage", "RateLimited"} <= alarms,
        "alarms: DLQ depth, circuit open, quota exhausted, orchestrator errors, the oldest job's age, any 429",
    )


def operator_env(url):
    """What the operator's commands run with: moto's endpoint, and no config file."""
    return dict(os.environ, AWS_ENDPOINT_URL=url, AWS_REGION="us-east-1", AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", PACELINE_CONFIG="/nonexistent.toml")


def stack_outputs(url, stack):
    return {o["OutputKey"]: o["OutputValue"] for o in client("cloudformation", url).describe_stacks(StackName=stack)["Stacks"][0]["Outputs"]}


def variables_as_lambda_keeps_them(url, stack):
    """Lambda keeps every variable as text; moto keeps a Number parameter's as a number,
    which the SDK cannot read. Put the orchestrator's as Lambda would have them."""
    lam = client("lambda", url)
    orchestrator = stack_outputs(url, stack)["OrchestratorFunctionName"]
    variables = lam.get_function_configuration(FunctionName=orchestrator)["Environment"]["Variables"]
    lam.update_function_configuration(FunctionName=orchestrator, Environment={"Variables": {k: str(v) for k, v in variables.items()}})


def check_operator_commands(paceline, url, stack):
    """`paceline lanes` on the deployed stack, found by its name alone."""
    env = operator_env(url)

    def paceline_json(*args):
        done = subprocess.run([paceline, *args, "--stack", stack, "--json"], env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise AssertionError(f"paceline {' '.join(args)}: {done.stderr}")
        return json.loads(done.stdout)

    print("the operator's commands on the deployed stack:")
    variables_as_lambda_keeps_them(url, stack)
    changed = paceline_json("lanes", "set", "gold", "--weight", "2", "--max-in-flight", "4")
    check(changed["weight"] == 2 and changed["tiers"] == ["20/s"] and changed["max_in_flight"] == 4, "lanes set: gold's change over its deployed settings")
    listed = {lane["lane"]: lane for lane in paceline_json("lanes", "list")}
    check(set(listed) == {"gold"} and listed["gold"]["settings"] == "config + operator", f"lanes list: the deployed lanes, gold changed: {listed}")
    check(listed["gold"]["backlog"] is None, "lanes list: no backlog by lane on SQS")
    acme = paceline_json("lanes", "show", "acme")
    check(acme["tiers"] == ["5/s"] and acme["weight"] == 1 and acme["settings"] == "defaults", "lanes show: a lane not named takes the deployed defaults")
    forgotten = paceline_json("lanes", "remove", "gold")
    check(forgotten["forgotten"]["weight"] == 2, "lanes remove: gold's change forgotten")
    check(paceline_json("lanes", "show", "gold")["weight"] == 3, "lanes show: gold as deployed again")
    gold = paceline_json("status", "--lane", "gold")
    check(
        gold["queue_is_the_stacks"] is True and gold["drain_estimate_seconds"] is None and [t["tier"] for t in gold["tiers"]] == ["20/s"],
        "status --lane: gold's tiers; the queue is the whole stack's (SQS counts no lane apart), so no drain estimate for gold",
    )


def check_enqueue_to_shards(paceline, url, stack):
    """`paceline enqueue --stack` on a stack of shards: each job on its lane's shard's
    queue, by the FNV-1a hash of the lane id; `paceline lanes move` and `lanes show`,
    a moved lane's job on its new shard's queue, and `status` counting every shard's."""
    print("enqueueing to a stack of shards:")
    variables_as_lambda_keeps_them(url, stack)
    lanes = [f"tenant-{n}" for n in range(6)]
    lines = "".join(json.dumps({"id": f"{lane}-job", "lane": lane, "request": {"method": "GET", "path": f"/items/{lane}"}}) + "\n" for lane in lanes)
    done = subprocess.run([paceline, "enqueue", "--stack", stack, "--json"], env=operator_env(url), input=lines, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"paceline enqueue: {done.stderr}")
    queues = json.loads(stack_outputs(url, stack)["ShardQueueUrls"])
    sqs = client("sqs", url)
    for index, queue in enumerate(queues):
        bodies = [json.loads(m["Body"]) for m in sqs.receive_message(QueueUrl=queue, MaxNumberOfMessages=10).get("Messages", [])]
        expected = sorted(lane for lane in lanes if fnv1a(lane) % len(queues) == index)
        check(sorted(body["lane"] for body in bodies) == expected, f"enqueue: shard {index}'s queue holds its lanes' jobs: {expected}")
    # `paceline lanes move`: a lane's jobs go to the shard it was moved to from then on.
    moved, home = "tenant-0", fnv1a("tenant-0") % len(queues)
    to = (home + 1) % len(queues)
    done = subprocess.run([paceline, "lanes", "move", moved, "--to-shard", str(to), "--stack", stack, "--json"], env=operator_env(url), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"paceline lanes move: {done.stderr}")
    check(json.loads(done.stdout) == {"lane": moved, "from_shard": home, "to_shard": to}, f"lanes move: {moved} from shard {home} to shard {to}")
    shown = subprocess.run([paceline, "lanes", "show", moved, "--stack", stack, "--json"], env=operator_env(url), capture_output=True, text=True, check=False)
    lives_there = shown.returncode == 0 and json.loads(shown.stdout).get("shard") == to
    check(lives_there, f"lanes show: {moved} lives on shard {to}" + ("" if lives_there else f": {shown.stdout}{shown.stderr}"))
    again = subprocess.run([paceline, "lanes", "move", moved, "--to-shard", str(to), "--stack", stack], env=operator_env(url), capture_output=True, text=True, check=False)
    check(again.returncode != 0 and f"lives on shard {to} already" in again.stderr, f"lanes move: refused where the lane is already ({again.stderr.strip()})")
    line = json.dumps({"id": "moved-job", "lane": moved, "request": {"method": "GET", "path": "/items/moved"}}) + "\n"
    done = subprocess.run([paceline, "enqueue", "--stack", stack], env=operator_env(url), input=line, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"paceline enqueue: {done.stderr}")
    bodies = [json.loads(m["Body"]) for m in sqs.receive_message(QueueUrl=queues[to], MaxNumberOfMessages=10, WaitTimeSeconds=1).get("Messages", [])]
    check([body["id"] for body in bodies] == ["moved-job"], f"enqueue: a moved lane's job goes to its new shard's queue ({to})")
    # `paceline status`: every shard's queue, and the whole stack's (all seven jobs received above, in flight).
    done = subprocess.run([paceline, "status", "--stack", stack, "--json"], env=operator_env(url), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"paceline status: {done.stderr}")
    status = json.loads(done.stdout)
    per_shard = [(shard["shard"], shard["visible"] + shard["not_visible"]) for shard in status.get("shards", [])]
    whole = status["queue"]["visible"] + status["queue"]["not_visible"]
    check(len(per_shard) == len(queues) and sum(n for _, n in per_shard) == whole == 7, f"status: each shard's queue and the whole stack's 7 jobs ({per_shard})")


def fnv1a(text):
    """The 64-bit FNV-1a hash of `text`, as a producer in Python computes a lane's shard."""
    hashed = 0xCBF29CE484222325
    for byte in text.encode():
        hashed = ((hashed ^ byte) * 0x100000001B3) % (1 << 64)
    return hashed


if __name__ == "__main__":
    deployed, sharded = main(sys.argv[1], sys.argv[2])
    if len(sys.argv) > 3:
        check_operator_commands(sys.argv[3], sys.argv[2], deployed)
        check_enqueue_to_shards(sys.argv[3], sys.argv[2], sharded)
