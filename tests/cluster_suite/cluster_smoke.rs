//! Smoke tests of the test cluster itself (tests/cluster/): host clients on
//! loopback only, CRDs, Jobs with a locally built image, in-cluster API
//! access and garbage collection.
//! Skipped without a cluster unless AGENTS_REQUIRE_CLUSTER=1 (see tests/support).

use crate::support;

use std::time::Duration;

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, ListParams, LogParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde_json::json;
use support::{wait_until, TestNamespace, BUSYBOX_IMAGE};

fn busybox_job(name: &str, script: &str) -> Job {
    serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "containers": [{
                    "name": "main",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", script],
                }],
            }},
        },
    }))
    .unwrap()
}

async fn job_pods(client: &Client, ns: &str, job: &str) -> Vec<Pod> {
    Api::<Pod>::namespaced(client.clone(), ns)
        .list(&ListParams::default().labels(&format!("batch.kubernetes.io/job-name={job}")))
        .await
        .unwrap()
        .items
}

async fn wait_job_finished(client: &Client, ns: &str, name: &str) -> Job {
    let jobs: Api<Job> = Api::namespaced(client.clone(), ns);
    wait_until(Duration::from_secs(120), "job to finish", || async {
        let job = jobs.get(name).await.ok()?;
        let done = job
            .status
            .as_ref()?
            .conditions
            .as_ref()?
            .iter()
            .any(|c| (c.type_ == "Complete" || c.type_ == "Failed") && c.status == "True");
        done.then_some(job)
    })
    .await
}

fn job_succeeded(job: &Job) -> bool {
    job.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "Complete" && c.status == "True")
        })
}

/// Host clients talk to the API server on loopback only (the network rule:
/// no host traffic to a private-range address): every kubeconfig the
/// scripts write names https://127.0.0.1:6443, the certificate also names
/// 127.0.0.2 (failure tests cut that address), pods reach the server on the
/// bridge through the `kubernetes` Service, and port 6443 is dropped on
/// every interface but lo and the bridge.
#[tokio::test]
async fn host_clients_use_loopback_and_pods_the_bridge() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let path = support::kubeconfig_path().unwrap();
    let kubeconfig = Kubeconfig::read_from(&path).unwrap();
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    assert_eq!(
        config.cluster_url.host(),
        Some("127.0.0.1"),
        "{}: {}",
        path.display(),
        config.cluster_url
    );

    // The components' kubeconfigs too, when this is the cluster of tests/cluster/up.
    let state = std::env::var("AGENTS_CLUSTER_STATE")
        .unwrap_or_else(|_| "/var/lib/agents-test-cluster".into());
    let pki = std::path::Path::new(&state).join("pki");
    if path.starts_with(&state) && pki.is_dir() {
        for name in [
            "admin",
            "controller-manager",
            "scheduler",
            "kubelet",
            "kube-proxy",
        ] {
            let file = pki.join(format!("{name}.kubeconfig"));
            let text = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
            let servers: Vec<&str> = text
                .lines()
                .filter_map(|l| l.trim().strip_prefix("server: "))
                .collect();
            assert_eq!(servers, ["https://127.0.0.1:6443"], "{}", file.display());
        }
        // Port 6443 answers only on lo and the bridge.
        let rules = std::process::Command::new("iptables")
            .args(["-S", "AGENTS-TEST-API"])
            .output()
            .expect("run iptables");
        let rules = String::from_utf8_lossy(&rules.stdout);
        for want in [
            "-A AGENTS-TEST-API -i lo -j RETURN",
            "-A AGENTS-TEST-API -i agents0 -j RETURN",
            "-A AGENTS-TEST-API -j DROP",
        ] {
            assert!(
                rules.lines().any(|l| l == want),
                "{want:?} not in:\n{rules}"
            );
        }
        let input = std::process::Command::new("iptables")
            .args(["-S", "INPUT"])
            .output()
            .expect("run iptables");
        let input = String::from_utf8_lossy(&input.stdout);
        assert!(
            input
                .lines()
                .any(|l| l.contains("--dport 6443") && l.ends_with("-j AGENTS-TEST-API")),
            "INPUT does not send port 6443 to AGENTS-TEST-API:\n{input}"
        );
    }

    // The second loopback address verifies (the certificate names it).
    let mut second = config.clone();
    second.cluster_url = "https://127.0.0.2:6443".parse().unwrap();
    let version = Client::try_from(second)
        .unwrap()
        .apiserver_version()
        .await
        .expect("the API server answers on 127.0.0.2 with a certificate naming it");
    assert!(!version.git_version.is_empty());

    // Pods: the `kubernetes` Service's endpoint is the advertise address on
    // the bridge, not loopback.
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let slice = slices
        .list(&ListParams::default().labels("kubernetes.io/service-name=kubernetes"))
        .await
        .unwrap()
        .items
        .into_iter()
        .next()
        .expect("the kubernetes Service has an EndpointSlice");
    let addresses: Vec<String> = slice
        .endpoints
        .iter()
        .flat_map(|e| e.addresses.clone())
        .collect();
    assert!(!addresses.is_empty(), "{slice:?}");
    for a in &addresses {
        assert!(
            !a.starts_with("127."),
            "pods would be sent to loopback: {a}"
        );
    }
}

#[tokio::test]
async fn crds_apply_and_are_served() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let crds = support::install_crds(&client).await;
    for crd in &crds {
        // Served: the resource can be listed through discovery by kubectl.
        let plural = &crd.spec.names.plural;
        let group = &crd.spec.group;
        support::kubectl_ok(["get", &format!("{plural}.{group}"), "-A", "-o", "name"]);
    }
    // The schema is published (OpenAPI v3) and kubectl can explain it.
    let explained = wait_until(
        Duration::from_secs(30),
        "kubectl explain session.spec",
        || async {
            let out = support::kubectl(["explain", "session.spec"]);
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
        },
    )
    .await;
    assert!(
        explained.contains("FIELDS") || explained.contains("DESCRIPTION"),
        "unexpected kubectl explain output:\n{explained}"
    );
}

#[tokio::test]
async fn job_with_local_image_completes_with_message_and_log() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let ns = TestNamespace::create(&client, "smoke-job").await;
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns.name);
    let script = "echo hello from the job; echo line two; \
                  printf 'result: ok' > /dev/termination-log";
    jobs.create(&PostParams::default(), &busybox_job("hello", script))
        .await
        .unwrap();
    let job = wait_job_finished(&client, &ns.name, "hello").await;
    let pods = job_pods(&client, &ns.name, "hello").await;
    assert!(
        job_succeeded(&job),
        "job failed: {:?}; pods: {pods:?}",
        job.status
    );
    assert_eq!(pods.len(), 1, "one pod expected: {pods:?}");
    let pod = &pods[0];
    let pod_name = pod.metadata.name.clone().unwrap();
    let terminated = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .and_then(|c| c.state.as_ref())
        .and_then(|s| s.terminated.as_ref())
        .expect("container terminated state");
    assert_eq!(terminated.exit_code, 0);
    assert_eq!(terminated.message.as_deref(), Some("result: ok"));
    let log = Api::<Pod>::namespaced(client.clone(), &ns.name)
        .logs(&pod_name, &LogParams::default())
        .await
        .unwrap();
    assert_eq!(log, "hello from the job\nline two\n");
    ns.delete(&client).await;
}

#[tokio::test]
async fn pod_reaches_api_server_through_service_with_its_token() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let ns = TestNamespace::create(&client, "smoke-incluster").await;
    let svc = Api::<Service>::namespaced(client.clone(), "default")
        .get("kubernetes")
        .await
        .unwrap();
    let cluster_ip = svc.spec.unwrap().cluster_ip.unwrap();
    // What an in-cluster client does: the Service address from the env, the
    // projected service-account token as bearer token. The request is a
    // SelfSubjectReview, so the answer names the identity the token proved.
    // (busybox wget speaks TLS but cannot verify certificates.)
    let script = r#"
        set -e
        SA=/var/run/secrets/kubernetes.io/serviceaccount
        echo "host=$KUBERNETES_SERVICE_HOST port=$KUBERNETES_SERVICE_PORT"
        test -s $SA/ca.crt
        wget -q -O - --no-check-certificate \
          --header "Authorization: Bearer $(cat $SA/token)" \
          --header "Content-Type: application/json" \
          --post-data '{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}' \
          "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/apis/authentication.k8s.io/v1/selfsubjectreviews"
        echo
        if wget -q -O - --no-check-certificate "https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT/api/v1/namespaces/default/secrets" >/dev/null 2>&1; then
          echo "anonymous request was allowed"; exit 3
        fi
        echo anonymous-refused
    "#;
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns.name);
    jobs.create(&PostParams::default(), &busybox_job("incluster", script))
        .await
        .unwrap();
    let job = wait_job_finished(&client, &ns.name, "incluster").await;
    let pods = job_pods(&client, &ns.name, "incluster").await;
    let pod_name = pods[0].metadata.name.clone().unwrap();
    let log = Api::<Pod>::namespaced(client.clone(), &ns.name)
        .logs(&pod_name, &LogParams::default())
        .await
        .unwrap();
    assert!(
        job_succeeded(&job),
        "in-cluster request failed; log:\n{log}"
    );
    let (first, rest) = log.split_once('\n').unwrap_or((&log, ""));
    assert_eq!(
        first,
        format!("host={cluster_ip} port=443"),
        "pod must use the kubernetes Service ClusterIP; log:\n{log}"
    );
    let review: serde_json::Value = serde_json::Deserializer::from_str(rest)
        .into_iter()
        .next()
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("no SelfSubjectReview JSON in log:\n{log}"));
    assert_eq!(
        review["status"]["userInfo"]["username"],
        format!("system:serviceaccount:{}:default", ns.name),
        "log:\n{log}"
    );
    assert!(log.contains("anonymous-refused"), "log:\n{log}");
    ns.delete(&client).await;
}

#[tokio::test]
async fn owner_deletion_garbage_collects_job_pods() {
    let Some(client) = support::cluster().await else {
        return;
    };
    let ns = TestNamespace::create(&client, "smoke-gc").await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns.name);
    let jobs: Api<Job> = Api::namespaced(client.clone(), &ns.name);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);

    // A ConfigMap owns job "owned"; job "direct" has no owner but its pods.
    let owner: ConfigMap = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"},
    }))
    .unwrap();
    let owner = cms.create(&PostParams::default(), &owner).await.unwrap();
    let mut owned = busybox_job("owned", "sleep 3600");
    owned.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "v1".into(),
            kind: "ConfigMap".into(),
            name: "owner".into(),
            uid: owner.metadata.uid.clone().unwrap(),
            block_owner_deletion: Some(true),
            controller: Some(false),
        },
    ]);
    jobs.create(&PostParams::default(), &owned).await.unwrap();
    jobs.create(&PostParams::default(), &busybox_job("direct", "sleep 3600"))
        .await
        .unwrap();

    for job in ["owned", "direct"] {
        wait_until(
            Duration::from_secs(60),
            &format!("a running pod of job {job}"),
            || async {
                job_pods(&client, &ns.name, job)
                    .await
                    .iter()
                    .any(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
                    .then_some(())
            },
        )
        .await;
    }

    // Foreground deletion of the ConfigMap: the GC deletes the Job, then its pods.
    cms.delete("owner", &DeleteParams::foreground())
        .await
        .unwrap();
    // Background deletion of a Job: the GC deletes its pods afterwards.
    jobs.delete("direct", &DeleteParams::background())
        .await
        .unwrap();

    wait_until(
        Duration::from_secs(90),
        "owner ConfigMap, jobs and their pods to be garbage collected",
        || async {
            let cm_gone = cms.get_opt("owner").await.ok()?.is_none();
            let jobs_gone = jobs
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .is_empty();
            let pods_gone = pods
                .list(&ListParams::default())
                .await
                .ok()?
                .items
                .is_empty();
            (cm_gone && jobs_gone && pods_gone).then_some(())
        },
    )
    .await;
    ns.delete(&client).await;
}
