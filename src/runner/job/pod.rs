//! The tool Job's objects, built from the API's own types (k8s-openapi):
//! the Job, its pod template, the wrapper's init container and the tool's
//! container, their volumes and security contexts, and the envelope's
//! ConfigMap. A misspelt field does not compile.

use super::*;
use k8s_openapi::api::batch::v1::JobSpec;
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, DownwardAPIVolumeFile, DownwardAPIVolumeSource,
    EmptyDirVolumeSource, EnvVar, EnvVarSource, KeyToPath, ObjectFieldSelector, PodSecurityContext,
    PodSpec, PodTemplateSpec, ResourceRequirements, SeccompProfile, SecretKeySelector,
    SecurityContext, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};

/// The volume the wrapper binary is shared through.
const WRAPPER_VOLUME: &str = "agents-bin";
/// The volume the envelope file comes from.
const INPUT_VOLUME: &str = "agents-input";
/// The tool's writable `/tmp`.
const TMP_VOLUME: &str = "tmp";

impl Owner {
    /// The controller reference to the owning Continuation.
    pub(super) fn reference(&self) -> Vec<OwnerReference> {
        vec![OwnerReference {
            api_version: format!("{}/{}", crate::api::GROUP, crate::api::VERSION),
            kind: "Continuation".into(),
            name: self.name.clone(),
            uid: self.uid.clone(),
            controller: Some(true),
            ..Default::default()
        }]
    }
}

impl JobRunner {
    /// The Job for one attempt (pure: no API call).
    pub fn build_job(
        &self,
        envelope: &CallEnvelope,
        spec: &IsolationSpec,
        attempt: u32,
        timeout: Duration,
        owner: &Owner,
        source: &EnvelopeSource,
    ) -> Result<Job, String> {
        check_runnable(spec)?;
        let token = &envelope.token;
        let session = envelope.context.session.0.as_str();
        let labels = job_labels(token, attempt);
        let (pod_annotations, input_volume) = envelope_input(source, session);
        let metadata = ObjectMeta {
            name: Some(job_name(token, attempt)),
            namespace: Some(self.namespace.clone()),
            labels: Some(labels.clone()),
            annotations: Some(strings([
                (ANNOTATION_TOKEN, token.as_str()),
                (ANNOTATION_SESSION, session),
            ])),
            owner_references: Some(owner.reference()),
            ..Default::default()
        };
        let template = PodTemplateSpec {
            metadata: Some(ObjectMeta {
                labels: Some(labels),
                annotations: Some(pod_annotations),
                ..Default::default()
            }),
            spec: Some(self.pod_spec(spec, input_volume)?),
        };
        Ok(Job {
            metadata,
            spec: Some(JobSpec {
                backoff_limit: Some(0),
                active_deadline_seconds: Some(deadline_seconds(timeout)),
                template,
                ..Default::default()
            }),
            status: None,
        })
    }

    /// The tool pod's spec: the wrapper's init container, the tool's
    /// container, their volumes.
    fn pod_spec(&self, spec: &IsolationSpec, input_volume: Volume) -> Result<PodSpec, String> {
        let uid = self.defaults.run_as_user;
        Ok(PodSpec {
            restart_policy: Some("Never".into()),
            service_account_name: Some(self.defaults.service_account.clone()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            termination_grace_period_seconds: Some(self.defaults.termination_grace_seconds),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(uid),
                run_as_group: Some(uid),
                seccomp_profile: Some(runtime_default_seccomp()),
                ..Default::default()
            }),
            init_containers: Some(vec![self.install_container()]),
            containers: vec![self.tool_container(spec)?],
            volumes: Some(vec![
                empty_dir(WRAPPER_VOLUME, "256Mi"),
                input_volume,
                empty_dir(TMP_VOLUME, &self.defaults.tmp_size_limit),
            ]),
            ..Default::default()
        })
    }

    /// The init container: copies the static `agents` binary from the
    /// agents image into the shared `emptyDir`.
    fn install_container(&self) -> Container {
        Container {
            name: INSTALL_CONTAINER.into(),
            image: Some(self.agents_image.clone()),
            image_pull_policy: Some(self.defaults.agents_image_pull_policy.clone()),
            command: Some(
                ["/agents", "tool-exec", "--install-to", WRAPPER_PATH]
                    .map(String::from)
                    .to_vec(),
            ),
            security_context: Some(container_security(self.defaults.run_as_user)),
            resources: Some(ResourceRequirements {
                requests: Some(quantities([("cpu", "50m"), ("memory", "32Mi")])),
                limits: Some(quantities([("cpu", "500m"), ("memory", "128Mi")])),
                ..Default::default()
            }),
            volume_mounts: Some(vec![mount(WRAPPER_VOLUME, WRAPPER_DIR, None)]),
            termination_message_policy: Some("File".into()),
            ..Default::default()
        }
    }

    /// The tool's container: its image, its command wrapped by the
    /// wrapper, the env its definition names, its limits.
    fn tool_container(&self, spec: &IsolationSpec) -> Result<Container, String> {
        let mut command: Vec<String> =
            [WRAPPER_PATH, "tool-exec", "--envelope", ENVELOPE_PATH, "--"]
                .map(String::from)
                .to_vec();
        command.extend(spec.command.iter().cloned());
        Ok(Container {
            name: TOOL_CONTAINER.into(),
            image: Some(spec.image.clone()),
            image_pull_policy: Some(self.defaults.tool_image_pull_policy.clone()),
            command: Some(command),
            args: Some(spec.args.clone()),
            env: Some(job_env(spec)?),
            resources: Some(self.tool_resources(spec)),
            security_context: Some(container_security(self.defaults.run_as_user)),
            volume_mounts: Some(vec![
                mount(WRAPPER_VOLUME, WRAPPER_DIR, Some(true)),
                mount(INPUT_VOLUME, INPUT_DIR, Some(true)),
                mount(TMP_VOLUME, "/tmp", None),
            ]),
            termination_message_path: Some(TERMINATION_LOG.into()),
            termination_message_policy: Some("File".into()),
            ..Default::default()
        })
    }

    /// The operator's limits and requests, with the tool's own limits over
    /// them.
    fn tool_resources(&self, spec: &IsolationSpec) -> ResourceRequirements {
        let mut limits = self.defaults.limits.clone();
        let mut requests = self.defaults.requests.clone();
        for (k, v) in &spec.limits {
            limits.insert(k.clone(), v.clone());
            // Without parsing quantities, the only request surely within
            // the limit is the limit itself.
            requests.insert(k.clone(), v.clone());
        }
        let typed =
            |m: BTreeMap<String, String>| m.into_iter().map(|(k, v)| (k, Quantity(v))).collect();
        ResourceRequirements {
            limits: Some(typed(limits)),
            requests: Some(typed(requests)),
            ..Default::default()
        }
    }

    /// The immutable ConfigMap an envelope too large for an annotation
    /// travels in, owned like the Job.
    pub(super) fn envelope_configmap_object(
        &self,
        name: &str,
        owner: &Owner,
        text: String,
    ) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(self.namespace.clone()),
                labels: Some(strings([
                    (LABEL_ROLE, ROLE_TOOL),
                    ("app.kubernetes.io/managed-by", "agents"),
                ])),
                owner_references: Some(owner.reference()),
                ..Default::default()
            },
            immutable: Some(true),
            data: Some([(ENVELOPE_FILE.to_string(), text)].into()),
            ..Default::default()
        }
    }
}

/// `Err` naming the fix when the tool cannot run as a Job.
fn check_runnable(spec: &IsolationSpec) -> Result<(), String> {
    if spec.image.trim().is_empty() {
        return Err("the isolated tool has no image; set tools[].container.image".into());
    }
    if spec.command.is_empty() {
        return Err(
            "the isolated tool has no command: the Job runner wraps the tool's command and \
             cannot read an image's entrypoint; set tools[].container.command"
                .into(),
        );
    }
    Ok(())
}

/// The Job's `activeDeadlineSeconds`: the timeout, rounded up, at least 1.
fn deadline_seconds(timeout: Duration) -> i64 {
    timeout.as_secs_f64().ceil().max(1.0) as i64
}

/// The labels of the Job and its pod.
fn job_labels(token: &ContinuationToken, attempt: u32) -> BTreeMap<String, String> {
    let attempt = attempt.to_string();
    strings([
        (LABEL_CONTINUATION, token_label(token).as_str()),
        (LABEL_ATTEMPT, attempt.as_str()),
        (LABEL_ROLE, ROLE_TOOL),
        ("app.kubernetes.io/managed-by", "agents"),
    ])
}

fn strings<const N: usize>(pairs: [(&str, &str); N]) -> BTreeMap<String, String> {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn quantities<const N: usize>(pairs: [(&str, &str); N]) -> BTreeMap<String, Quantity> {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_string(), Quantity(v.to_string())))
        .collect()
}

fn runtime_default_seccomp() -> SeccompProfile {
    SeccompProfile {
        type_: "RuntimeDefault".into(),
        ..Default::default()
    }
}

/// Every container's: non-root, read-only root, no privilege escalation,
/// all capabilities dropped, `RuntimeDefault` seccomp.
fn container_security(uid: i64) -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        run_as_user: Some(uid),
        run_as_group: Some(uid),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Default::default()
        }),
        seccomp_profile: Some(runtime_default_seccomp()),
        ..Default::default()
    }
}

fn empty_dir(name: &str, size_limit: &str) -> Volume {
    Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            size_limit: Some(Quantity(size_limit.into())),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn mount(volume: &str, path: &str, read_only: Option<bool>) -> VolumeMount {
    VolumeMount {
        name: volume.into(),
        mount_path: path.into(),
        read_only,
        ..Default::default()
    }
}

/// The pod's annotations and the volume the envelope file comes from.
fn envelope_input(source: &EnvelopeSource, session: &str) -> (BTreeMap<String, String>, Volume) {
    match source {
        EnvelopeSource::Annotation(text) => {
            let file = DownwardAPIVolumeFile {
                path: ENVELOPE_FILE.into(),
                field_ref: Some(ObjectFieldSelector {
                    field_path: format!("metadata.annotations['{ANNOTATION_ENVELOPE}']"),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let volume = Volume {
                name: INPUT_VOLUME.into(),
                downward_api: Some(DownwardAPIVolumeSource {
                    items: Some(vec![file]),
                    ..Default::default()
                }),
                ..Default::default()
            };
            let annotations = strings([(ANNOTATION_ENVELOPE, text), (ANNOTATION_SESSION, session)]);
            (annotations, volume)
        }
        EnvelopeSource::ConfigMap(name) => {
            let item = KeyToPath {
                key: ENVELOPE_FILE.into(),
                path: ENVELOPE_FILE.into(),
                ..Default::default()
            };
            let volume = Volume {
                name: INPUT_VOLUME.into(),
                config_map: Some(ConfigMapVolumeSource {
                    name: name.clone(),
                    items: Some(vec![item]),
                    ..Default::default()
                }),
                ..Default::default()
            };
            (strings([(ANNOTATION_SESSION, session)]), volume)
        }
    }
}

/// The tool container's env: `HOME`, then the variables the definition
/// names, secrets as `secretKeyRef` (the wrapper adds the runner's own).
fn job_env(spec: &IsolationSpec) -> Result<Vec<EnvVar>, String> {
    let mut env = vec![EnvVar {
        name: "HOME".into(),
        value: Some("/tmp".into()),
        ..Default::default()
    }];
    for var in &spec.env {
        let name = var.name.as_str();
        check_var_name(name, false)?;
        let entry = match (&var.value, &var.secret) {
            (Some(v), None) => EnvVar {
                name: name.into(),
                value: Some(v.clone()),
                ..Default::default()
            },
            (None, Some(r)) => EnvVar {
                name: name.into(),
                value_from: Some(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector {
                        name: r.name.clone(),
                        key: r.key.clone(),
                        optional: Some(false),
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            },
            _ => {
                return Err(format!(
                    "the tool's env: {name:?} needs exactly one of value and secret"
                ))
            }
        };
        env.retain(|e| e.name != name);
        env.push(entry);
    }
    Ok(env)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::fixtures::{image_tool, value_var};
    use crate::runner::job::tests::{envelope, runner, token};
    use serde_json::json;

    fn owner() -> Owner {
        Owner {
            name: "demo-t1-c0".into(),
            uid: "u-1".into(),
        }
    }

    /// The arguments of the hardening test's call: what must never reach
    /// the pod's spec.
    const ARGS: &str = r#"{"cmd":"$(rm -rf /)","q":"it's \"quoted\""}"#;

    fn tool() -> IsolationSpec {
        image_tool("busybox:ci", &["sh", "-c"], &["cat"], ("MODE", "fast"))
    }

    /// The Job of attempt `attempt` of the call with [`ARGS`].
    async fn build(
        spec: &IsolationSpec,
        attempt: u32,
        timeout: Duration,
        source: EnvelopeSource,
    ) -> Result<serde_json::Value, String> {
        runner()
            .await
            .build_job(&envelope(ARGS), spec, attempt, timeout, &owner(), &source)
            .map(|job| serde_json::to_value(&job).unwrap())
    }

    fn in_annotation() -> EnvelopeSource {
        EnvelopeSource::Annotation(serde_json::to_string(&envelope(ARGS)).unwrap())
    }

    #[tokio::test]
    async fn the_job_is_hardened_and_carries_no_arguments() {
        let text = serde_json::to_string(&envelope(ARGS)).unwrap();
        let v = build(&tool(), 2, Duration::from_millis(30_500), in_annotation())
            .await
            .unwrap();
        assert_eq!(v["metadata"]["name"], job_name(&token(), 2));
        assert_eq!(v["metadata"]["labels"][LABEL_CONTINUATION], "demo-t1-c0");
        assert_eq!(v["metadata"]["labels"][LABEL_ATTEMPT], "2");
        assert_eq!(v["metadata"]["ownerReferences"][0]["uid"], "u-1");
        assert_eq!(v["metadata"]["ownerReferences"][0]["controller"], true);
        assert_eq!(v["spec"]["backoffLimit"], 0);
        assert_eq!(v["spec"]["activeDeadlineSeconds"], 31);
        // No TTL until the result is recorded (`release_jobs`).
        assert!(v["spec"].get("ttlSecondsAfterFinished").is_none());
        let pod = &v["spec"]["template"];
        assert_eq!(pod["metadata"]["annotations"][ANNOTATION_ENVELOPE], text);
        let ps = &pod["spec"];
        assert_eq!(ps["automountServiceAccountToken"], false);
        assert_eq!(ps["enableServiceLinks"], false);
        assert_eq!(ps["restartPolicy"], "Never");
        assert_eq!(ps["securityContext"]["runAsNonRoot"], true);
        for c in [&ps["containers"][0], &ps["initContainers"][0]] {
            let sc = &c["securityContext"];
            assert_eq!(sc["allowPrivilegeEscalation"], false);
            assert_eq!(sc["readOnlyRootFilesystem"], true);
            assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]));
            assert_eq!(sc["seccompProfile"]["type"], "RuntimeDefault");
            assert!(c["resources"]["limits"]["memory"].is_string());
        }
        // The arguments are only in the annotation, never in the spec.
        let spec_text = serde_json::to_string(ps).unwrap();
        assert!(!spec_text.contains("rm -rf"), "{spec_text}");
    }

    #[tokio::test]
    async fn the_tool_container_wraps_the_command_with_the_named_env_and_limits() {
        let v = build(&tool(), 2, Duration::from_millis(30_500), in_annotation())
            .await
            .unwrap();
        let tool = &v["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(tool["name"], TOOL_CONTAINER);
        assert_eq!(
            tool["command"],
            json!([
                WRAPPER_PATH,
                "tool-exec",
                "--envelope",
                ENVELOPE_PATH,
                "--",
                "sh",
                "-c"
            ])
        );
        assert_eq!(tool["args"], json!(["cat"]));
        assert_eq!(tool["resources"]["limits"]["memory"], "64Mi");
        assert_eq!(tool["resources"]["requests"]["memory"], "64Mi");
        assert_eq!(tool["resources"]["limits"]["cpu"], "500m");
        assert_eq!(
            tool["env"],
            json!([
                {"name": "HOME", "value": "/tmp"},
                {"name": "MODE", "value": "fast"},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "gh", "key": "token", "optional": false}}},
            ])
        );
    }

    #[tokio::test]
    async fn reserved_names_and_missing_commands_are_refused() {
        let second = Duration::from_secs(1);
        let mut bad = tool();
        bad.env.push(value_var("AGENTS_TOKEN", "x"));
        let e = build(&bad, 1, second, in_annotation()).await.unwrap_err();
        assert!(e.contains("AGENTS_TOKEN"), "{e}");
        let no_cmd = IsolationSpec {
            command: vec![],
            ..tool()
        };
        let e = build(&no_cmd, 1, second, in_annotation())
            .await
            .unwrap_err();
        assert!(e.contains("command"), "{e}");
    }

    #[tokio::test]
    async fn large_envelopes_come_from_a_configmap() {
        let second = Duration::from_secs(1);
        let v = build(&tool(), 1, second, EnvelopeSource::ConfigMap("cm".into()))
            .await
            .unwrap();
        assert_eq!(
            v["spec"]["template"]["spec"]["volumes"][1]["configMap"]["name"],
            "cm"
        );
        assert!(v["spec"]["template"]["metadata"]["annotations"]
            .get(ANNOTATION_ENVELOPE)
            .is_none());
    }

    /// The Job (both envelope sources) and the envelope's ConfigMap render
    /// exactly as the `json!`-built ones did before the objects were typed
    /// (`golden/`, captured from that code): nothing drifted.
    #[tokio::test]
    async fn the_typed_objects_render_as_the_json_built_ones_did() {
        let r = runner().await;
        let env = envelope(ARGS);
        let mut spec = tool();
        // A variable the definition names again replaces the default.
        spec.env.push(value_var("HOME", "/home/x"));
        let text = serde_json::to_string(&env).unwrap();
        let second = Duration::from_secs(1);
        let in_annotation = EnvelopeSource::Annotation(text);
        let in_configmap = EnvelopeSource::ConfigMap("cm".into());
        let cases = [
            (
                serde_json::to_value(
                    r.build_job(
                        &env,
                        &spec,
                        2,
                        Duration::from_millis(30_500),
                        &owner(),
                        &in_annotation,
                    )
                    .unwrap(),
                ),
                include_str!("golden/job-annotation.json"),
            ),
            (
                serde_json::to_value(
                    r.build_job(&env, &spec, 1, second, &owner(), &in_configmap)
                        .unwrap(),
                ),
                include_str!("golden/job-configmap.json"),
            ),
            (
                serde_json::to_value(r.envelope_configmap_object(
                    "demo-t1-c0-a1-x",
                    &owner(),
                    "{}".into(),
                )),
                include_str!("golden/envelope-configmap.json"),
            ),
        ];
        for (typed, golden) in cases {
            let golden: serde_json::Value = serde_json::from_str(golden).unwrap();
            let typed = typed.unwrap();
            assert_eq!(
                typed,
                golden,
                "typed:\n{}",
                serde_json::to_string_pretty(&typed).unwrap()
            );
        }
    }
}
