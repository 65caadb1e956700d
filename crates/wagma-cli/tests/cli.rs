//! The `wagma` command end to end, on tiny settings so that it cannot rot.

mod common;
use common::{bench_collectives_rows, launch_tcp_train, ok, ok_json, tmp, wagma};
use std::path::PathBuf;

#[test]
fn bench_collectives_runs_over_mem_and_tcp() {
    for transport in ["mem", "tcp"] {
        let rows = bench_collectives_rows(wagma(), transport, 3);
        // Over TCP raw loopback streams come last, as the references: one alone, and one per
        // rank at once.
        assert_eq!(rows.len(), if transport == "tcp" { 9 } else { 7 });
        for r in &rows {
            assert!(r["vs_memcpy"].as_f64().unwrap() > 0.0);
            assert!(r["bus_gb_per_s"].as_f64().unwrap() > 0.0);
            // The memory bound is computed for the in-process transport only.
            assert_eq!(
                r["memory_bound_gb_per_s"].is_number(),
                transport == "mem",
                "{r}"
            );
            // The CPU kept busy is measured where each rank is a process of its own (and in
            // the streams' threads).
            if transport == "tcp" {
                common::assert_cpu_measured(r);
            } else {
                assert!(r["cpu"].is_null(), "{r}");
            }
        }
        // The least bytes a rank sends: 2(n-1)/n buffers of 4,000 bytes in an allreduce of
        // n (3 ranks; groups of 2), one buffer per neighbour in the exchange.
        let least = |i: usize| rows[i]["optimal_bytes_per_rank"].as_u64().unwrap();
        assert_eq!(
            [least(0), least(1), least(2), least(4), least(5), least(6)],
            [5333, 5333, 4000, 4000, 4000, 8000]
        );
        assert_eq!(rows[4]["algorithm"], "reduce-broadcast");
        if transport == "tcp" {
            assert_eq!(rows[7]["collective"], "loopback-stream");
            assert_eq!(rows[8]["collective"], "loopback-streams");
            assert_eq!(rows[8]["members"], 3);
        }
    }
}

#[test]
fn bad_numbers_are_refused_with_a_message() {
    let out = wagma()
        .args(["bench", "collectives", "--ranks", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("ranks"));
    let out = wagma()
        .args(["bench", "collectives", "--ranks", "4", "--group-size", "5"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("group size"));
}

#[test]
fn bench_imbalance_runs_every_algorithm_over_mem_and_tcp() {
    for transport in ["mem", "tcp"] {
        let out = wagma()
            .args([
                "bench",
                "imbalance",
                "--transport",
                transport,
                "--ranks",
                "4",
                "--steps",
                "6",
                "--time-scale",
                "0.002",
                "--model-params",
                "1000",
                "--profile",
                "lengths",
                "--json",
            ])
            .output()
            .unwrap();
        let v = ok_json(&out);
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 8);
        let ideal = v["ideal_samples_per_s"].as_f64().unwrap();
        for r in rows {
            let bound = r["bound_samples_per_s"].as_f64().unwrap();
            assert!(bound > 0.0 && bound <= ideal * (1.0 + 1e-9), "{r}");
            assert!(r["samples_per_s"].as_f64().unwrap() > 0.0);
            assert_eq!(r["measured"]["steps"].as_u64(), Some(6));
            // Every rank's time is compute, waiting or overhead, and no rank outlasts the
            // job (f32 totals: a relative slack).
            let m = &r["measured"];
            let part = |k: &str| m[k].as_f64().unwrap();
            let (overhead, wall) = (part("overhead_s"), part("wall_s"));
            assert!(overhead >= 0.0, "{r}");
            let accounted = part("wait_s") + part("compute_s") + overhead;
            assert!(accounted <= 4.0 * wall * (1.0 + 1e-4) + 1e-6, "{r}");
        }
    }
}

#[test]
fn bench_imbalance_refuses_bad_options() {
    for args in [
        vec!["--algos", "sgd++"],
        vec!["--profile", "bursty"],
        vec!["--algos", "sgp", "--peers", "4", "--ranks", "4"],
        vec!["--tau", "0", "--algos", "wagma"],
        vec!["--time-scale", "-1"],
    ] {
        let out = wagma()
            .args(["bench", "imbalance", "--steps", "2"])
            .args(&args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(!out.stderr.is_empty());
    }
}

/// The `summary.json` a run wrote to `dir`.
fn summary(dir: &std::path::Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap()
}

/// `wagma train --config FILE` (FILE holding `file`) on the built-in data with `flags`, quiet,
/// into a fresh directory named after `name`: the directory, the file and the output.
fn train_with_config(
    name: &str,
    file: &str,
    flags: &[&str],
) -> (PathBuf, PathBuf, std::process::Output) {
    let dir = tmp(name);
    let cfg = dir.with_extension("toml");
    std::fs::write(&cfg, file).unwrap();
    let out = wagma()
        .args(["train", "--config"])
        .arg(&cfg)
        .args(flags)
        .args(["--quiet", "true", "--dataset", "builtin", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    (dir, cfg, out)
}

#[test]
fn train_writes_metrics_and_summary_and_honours_a_config_file() {
    let (dir, cfg, out) = train_with_config(
        "train",
        "workload = \"image\"\nalgo = \"local-sgd\"\nperiod = 2\nsteps = 1000\neval-every = 5\nranks = 3\n",
        &["--steps", "10"],
    );
    ok(&out);
    let s = summary(&dir);
    assert_eq!(s["steps"], 10, "the flag overrides the file");
    assert_eq!(s["ranks"], 3);
    assert_eq!(s["label"], "local-sgd H=2");
    let lines = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 2);
    let first: serde_json::Value = serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert_eq!(first["iteration"], 5);
    assert!(first["consensus"]["accuracy"].as_f64().unwrap() > 0.0);
    assert!(first["replica0"]["accuracy"].is_number());
    assert!(String::from_utf8_lossy(&out.stdout).contains("summary.json"));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_file(&cfg);
}

#[test]
fn train_in_epochs_schedules_and_evaluates_the_steps_it_runs() {
    // 0.0055 epochs of the 8,000 built-in samples at 2 ranks x 4: 6 iterations.
    let dir = tmp("train-epochs");
    let out = wagma()
        .args(["train", "--epochs", "0.0055", "--ranks", "2"])
        .args(["--batch", "4", "--width", "4", "--quiet", "true"])
        .args(["--dataset", "builtin"])
        .arg("--out")
        .arg(&dir)
        .output()
        .unwrap();
    ok(&out);
    let s = summary(&dir);
    assert_eq!(s["steps"], 6);
    // The schedule ends with the run.
    assert_eq!(s["optimizer"]["lr"]["total"], 6);
    // The default evaluation period is a sixth of the run.
    let lines = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 6);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_config_file_with_both_steps_and_epochs_is_refused() {
    let (dir, cfg, out) = train_with_config("train-both", "steps = 100\nepochs = 2.0\n", &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("steps and epochs exclude each other"), "{err}");
    assert!(!dir.exists(), "nothing ran");
    let _ = std::fs::remove_file(&cfg);
}

#[test]
fn a_benchmark_started_by_a_launcher_joins_its_job() {
    // Each process is one rank of the launcher's job; rank 0 prints the report (a process that
    // started ranks of its own would leave 3 jobs of 3 and no single report).
    let out = wagma()
        .args(["launch", "-n", "3", "--timeout", "120", "--"])
        .args(["wagma", "bench", "imbalance", "--transport", "tcp"])
        .args(["--ranks", "3"])
        .args(["--algos", "wagma,allreduce-sgd", "--steps", "4"])
        .args(["--model-params", "1000", "--profile", "none", "--json"])
        .output()
        .unwrap();
    let v = ok_json(&out);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{v}");
    assert_eq!(rows[0]["measured"]["ranks"], 3, "{v}");
}

/// The CPUs in a `Cpus_allowed_list` ("0-3,6").
fn cpus_in(list: &str) -> usize {
    list.split(',')
        .map(|part| match part.split_once('-') {
            Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
            None => 1,
        })
        .sum()
}

/// The CPUs this process may run on (its affinity mask, online CPUs only).
fn usable_cpus() -> Vec<usize> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set that sched_getaffinity fills;
    // CPU_ISSET reads within it below CPU_SETSIZE.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
            0
        );
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// How many physical cores the usable CPUs belong to.
fn usable_cores() -> usize {
    let mut cores: Vec<String> = usable_cpus()
        .into_iter()
        .map(|c| {
            let path = format!("/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list");
            std::fs::read_to_string(path).unwrap_or_else(|_| c.to_string())
        })
        .collect();
    cores.sort();
    cores.dedup();
    cores.len()
}

#[test]
fn launch_binds_each_rank_to_cpus_of_its_own() {
    // Every rank's `Cpus_allowed_list`, sorted (which rank printed which does not matter).
    let allowed = |bind: &str| -> Vec<String> {
        let out = wagma()
            .args([
                "launch",
                "-n",
                "2",
                "--timeout",
                "120",
                "--cpu-bind",
                bind,
                "--",
            ])
            .args(["sh", "-c", "grep Cpus_allowed_list: /proc/self/status"])
            .output()
            .unwrap();
        ok(&out);
        let mut lists: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once(':').map(|(_, v)| v.trim().to_string()))
            .collect();
        lists.sort();
        lists
    };
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let own = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string();
    let usable = usable_cpus().len();
    assert_eq!(allowed("none"), [own.clone(), own.clone()]);
    let core = allowed("core");
    assert_eq!(core.len(), 2, "{core:?}");
    for c in &core {
        assert!(c.parse::<usize>().is_ok(), "not one CPU: {c}");
    }
    if usable >= 2 {
        assert_ne!(core[0], core[1], "two ranks on one CPU: {core:?}");
    } else {
        assert_eq!(core[0], core[1]);
    }
    // A CPU quota below two CPUs' time leaves the job unbound, as too few cores do.
    let busy = std::thread::available_parallelism().map_or(1, |n| n.get());
    let auto = allowed("auto");
    if usable_cores().min(busy) >= 2 {
        // Each rank a share of the CPUs, not the same share.
        assert_ne!(auto[0], auto[1], "{auto:?}");
        let counts: Vec<usize> = auto.iter().map(|a| cpus_in(a)).collect();
        assert!(counts.iter().all(|&n| n >= 1), "{auto:?} of {own}");
        assert!(counts.iter().sum::<usize>() <= usable, "{auto:?} of {own}");
    } else {
        assert_eq!(auto, [own.clone(), own]);
    }
}

#[test]
fn launch_runs_training_over_tcp() {
    let dir = tmp("launch");
    let out = launch_tcp_train(3)
        .args(["--steps", "12", "--eval-every", "6", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    ok(&out);
    let s = summary(&dir);
    assert_eq!(s["ranks"], 3);
    assert_eq!(s["execution"], "tcp");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn train_under_a_launcher_joins_its_job_without_transport_flag() {
    // No --transport: every process must be one rank of the launcher's 3-rank job, not a
    // job of its own; bare boolean flags and Adam on the way.
    let dir = tmp("launch-implicit");
    let out = wagma()
        .args(["launch", "-n", "3", "--timeout", "120", "--"])
        .args([
            "wagma",
            "train",
            "--dataset",
            "builtin",
            "--quiet",
            "--optimizer",
            "adam",
        ])
        .args(["--steps", "6", "--eval-every", "3", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    ok(&out);
    let s = summary(&dir);
    assert_eq!(s["ranks"], 3);
    assert_eq!(s["execution"], "tcp");
    assert_eq!(s["optimizer"]["kind"], "adam");
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    for l in metrics.lines() {
        let r: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(r["train_loss"].as_f64().is_some_and(|x| x > 0.0), "{r}");
    }
    // In-process execution under a launcher would start one job per process: refused.
    let out = wagma()
        .args(["launch", "-n", "2", "--timeout", "120", "--"])
        .args([
            "wagma",
            "train",
            "--dataset",
            "builtin",
            "--quiet",
            "--deterministic",
        ])
        .args(["--steps", "2", "--out"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("every process would train a job of its own"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn launch_names_the_rank_that_failed() {
    let out = wagma()
        .args([
            "launch",
            "-n",
            "2",
            "--",
            "sh",
            "-c",
            "if [ \"$WAGMA_RANK\" = 1 ]; then exit 7; fi; sleep 0.2",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("rank 1 failed"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn bad_train_input_fails_cleanly_without_touching_earlier_outputs() {
    let dir = tmp("bad");
    ok(&wagma()
        .args([
            "train",
            "--steps",
            "4",
            "--ranks",
            "2",
            "--quiet",
            "true",
            "--dataset",
            "builtin",
            "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap());
    let before = std::fs::read(dir.join("summary.json")).unwrap();
    let junk = tmp("junk-data");
    std::fs::create_dir_all(&junk).unwrap();
    std::fs::write(junk.join("train-images-idx3-ubyte"), b"garbage").unwrap();
    std::fs::write(junk.join("train-labels-idx1-ubyte"), b"garbage").unwrap();
    let corrupt = tmp("corrupt-ckpt");
    std::fs::create_dir_all(&corrupt).unwrap();
    std::fs::write(corrupt.join("meta.json"), b"{ not json").unwrap();
    let junk_s = junk.to_string_lossy().into_owned();
    let corrupt_s = corrupt.to_string_lossy().into_owned();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--workload", "speech"], "unknown workload"),
        (vec!["--algo", "adam-sgd"], "algorithm"),
        (vec!["--eval-every", "many"], "invalid value"),
        (vec!["--ranks", "0"], "ranks"),
        (vec!["--tau", "0"], "tau"),
        (vec!["--algo", "sgp", "--peers", "9"], "peers"),
        (
            vec!["--algo", "sgp", "--sgp-offsets", "cycling"],
            "sgp-offsets",
        ),
        (vec!["--late-gradients", "keep"], "late-gradients"),
        (vec!["--data", "/nonexistent/mnist"], "/nonexistent/mnist"),
        (vec!["--data", &junk_s], "IDX"),
        (vec!["--resume", &corrupt_s], "unreadable"),
        (vec!["--resume", "/nonexistent/ckpt"], "no checkpoint"),
        (vec!["--imbalance", "bursty"], "imbalance profile"),
        (vec!["--optimizer", "adamax"], "optimizer"),
        (vec!["--optimizer", "adam", "--beta1", "0"], "beta1"),
        (vec!["--optimizer", "adam", "--beta2", "-0.5"], "beta2"),
        (vec!["--optimizer", "adamw", "--eps", "0"], "eps"),
        (vec!["--lr", "0"], "learning-rate"),
        (vec!["--lr", "-0.1"], "learning-rate"),
        (vec!["--schedule", "exponential"], "schedule"),
        (vec!["--device", "tpu"], "unknown device"),
        (vec!["--device", "cuda"], "--features cuda"),
        (vec!["--device", "wgpu"], "--features wgpu"),
    ];
    for (mut args, needle) in cases {
        if !args.contains(&"--data") {
            args.extend(["--dataset", "builtin"]);
        }
        let out = wagma()
            .args(["train", "--steps", "4", "--ranks", "2", "--quiet", "true"])
            .args(&args)
            .arg("--out")
            .arg(&dir)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(
            std::fs::read(dir.join("summary.json")).unwrap(),
            before,
            "{args:?} touched the earlier outputs"
        );
    }
    let out = wagma()
        .args([
            "train",
            "--steps",
            "4",
            "--quiet",
            "true",
            "--dataset",
            "builtin",
            "--out",
            "/proc/wagma-no-such-dir",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/proc/wagma-no-such-dir"));
    for d in [&dir, &junk, &corrupt] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn simulate_runs_the_authors_variants_of_the_baselines() {
    let sim = |extra: &[&str]| {
        ok_json(
            &wagma()
                .args(["simulate", "run", "--ranks", "16", "--steps", "30"])
                .args(["--model-params", "1000", "--peers", "2", "--json"])
                .args(extra)
                .output()
                .unwrap(),
        )
    };
    let disjoint = sim(&["--algo", "sgp"]);
    let sliding = sim(&["--algo", "sgp", "--sgp-offsets", "sliding"]);
    assert_eq!(disjoint["algorithm"], "sgp 2n");
    assert_eq!(sliding["algorithm"], "sgp 2n sliding");
    // Other in-neighbours, other waits.
    assert_ne!(disjoint["samples_per_s"], sliding["samples_per_s"]);
    let kept = sim(&["--algo", "eager-sgd-solo"]);
    let dropped = sim(&["--algo", "eager-sgd-solo", "--late-gradients", "drop"]);
    assert_eq!(dropped["algorithm"], "eager-sgd solo sync=32 drop-late");
    // Dropping changes what a round sums, never when it runs.
    assert_eq!(kept["samples_per_s"], dropped["samples_per_s"]);
    assert!(kept["samples_per_s"].as_f64().unwrap() > 0.0);
    // Blocking rounds every 5 steps make solo eager-SGD wait.
    let unsynced = sim(&["--algo", "eager-sgd-solo", "--eager-sync", "never"]);
    let synced = sim(&["--algo", "eager-sgd-solo", "--eager-sync", "5"]);
    assert_eq!(unsynced["algorithm"], "eager-sgd solo sync=never");
    assert_eq!(synced["algorithm"], "eager-sgd solo sync=5");
    assert!(unsynced["samples_per_s"].as_f64() > synced["samples_per_s"].as_f64());
    let small = sim(&["--algo", "wagma", "--group-size", "2"]);
    assert_eq!(small["algorithm"], "wagma S=2 tau=10");
    let blocking = sim(&["--algo", "wagma", "--group-size", "2", "--blocking"]);
    assert_eq!(blocking["algorithm"], "wagma S=2 tau=10 blocking");
    assert!(blocking["samples_per_s"].as_f64() < small["samples_per_s"].as_f64());
    let h4 = sim(&["--algo", "local-sgd", "--period", "4"]);
    assert_eq!(h4["algorithm"], "local-sgd H=4");
    // Chained pieces: the label says so, and the bound waits for them too (every rank within
    // 4 hops), so it is below the bound of one exchange.
    let one = sim(&["--algo", "d-psgd"]);
    let pieces = sim(&["--algo", "d-psgd", "--exchange-pieces", "4"]);
    assert_eq!(pieces["algorithm"], "d-psgd pieces=4");
    assert!(pieces["bound_samples_per_s"].as_f64() < one["bound_samples_per_s"].as_f64());
    assert!(pieces["samples_per_s"].as_f64() <= pieces["bound_samples_per_s"].as_f64());
    // AD-PSGD's gossip loop: the step never waits for the passive peer's reply, which at
    // ResNet-50's size (the default) takes long enough to show; the gossip meets its bound.
    let resnet = |extra: &[&str]| {
        ok_json(
            &wagma()
                .args([
                    "simulate", "run", "--ranks", "16", "--steps", "30", "--json",
                ])
                .args(["--algo", "ad-psgd"])
                .args(extra)
                .output()
                .unwrap(),
        )
    };
    let awaited = resnet(&[]);
    let gossip = resnet(&["--ad-psgd-gossip", "2"]);
    assert_eq!(awaited["algorithm"], "ad-psgd");
    assert_eq!(gossip["algorithm"], "ad-psgd gossip=2");
    assert!(gossip["samples_per_s"].as_f64() > awaited["samples_per_s"].as_f64());
    let (rate, bound) = (&gossip["samples_per_s"], &gossip["bound_samples_per_s"]);
    assert!(
        rate.as_f64().unwrap() >= 0.999 * bound.as_f64().unwrap(),
        "{rate} of {bound}"
    );
}

#[test]
fn bench_paper_in_virtual_time_reproduces_its_results_exactly() {
    for workload in ["image", "navigate", "translate"] {
        let dir = tmp(&format!("paper-repro-{workload}"));
        let run = |steps: &str, extra: &[&str]| {
            let out = wagma()
                .args(["bench", "paper", "--workload", workload, "--ranks", "4"])
                .args(["--steps", steps, "--eval-points", "2", "--batch", "4"])
                .args(["--algos", "wagma,ad-psgd", "--out"])
                .arg(&dir)
                .args(extra)
                .output()
                .unwrap();
            ok(&out);
            let reused = String::from_utf8_lossy(&out.stderr)
                .matches("(reused)")
                .count();
            (std::fs::read(dir.join("results.json")).unwrap(), reused)
        };
        let (a, b) = (run("4", &[]), run("4", &[]));
        assert!(a == b, "{workload}: two runs wrote different results.json");
        assert_eq!(a.1, 0);
        // Resumed, both runs are taken from the directory and the results are the same; with
        // another configuration nothing is reused.
        let resumed = run("4", &["--resume"]);
        assert_eq!(resumed, (a.0.clone(), 2), "{workload}");
        assert_eq!(run("2", &["--resume"]).1, 0, "{workload}");
        let a = resumed.0;
        let r: serde_json::Value = serde_json::from_slice(&a).unwrap();
        for run in r["runs"].as_array().unwrap() {
            let curve = run["curve"].as_array().unwrap();
            assert_eq!(curve.len(), 2, "{workload}");
            for e in curve {
                assert!(e["replica0"].is_object() && e["consensus"].is_object());
                assert!(e["wall_s"].as_f64().unwrap() > 0.0);
                assert!(e["consensus_distance"].is_number());
            }
            assert_eq!(run["summary"]["execution"], "virtual");
            // The virtual time of 4 iterations of the workload's profile: at least 4 of its
            // shortest steps (0.45 s, 0.179 s, 1.7 s).
            let least = match workload {
                "image" => 4.0 * 0.45,
                "translate" => 4.0 * 0.179,
                _ => 4.0 * 1.7,
            };
            assert!(
                run["summary"]["wall_s"].as_f64().unwrap() >= least,
                "{workload}"
            );
        }
        let cost: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("cost.json")).unwrap()).unwrap();
        assert!(cost[0]["real_ms_per_rank_iteration"].as_f64().unwrap() > 0.0);
        let report = std::fs::read_to_string(dir.join("report.md")).unwrap();
        assert!(report.contains("virtual time") && report.contains("rank 0"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn bench_paper_smoke_writes_results_plots_and_report() {
    let dir = tmp("paper");
    let out = wagma()
        .args([
            "bench",
            "paper",
            "--workload",
            "image",
            "--ranks",
            "3",
            "--steps",
            "6",
            "--eval-points",
            "2",
            "--ablations",
            "--time-scale",
            "0.002",
            "--out",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    ok(&out);
    let r: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("results.json")).unwrap()).unwrap();
    let runs = r["runs"].as_array().unwrap();
    assert!(runs.len() > 8, "all algorithms and the ablations");
    assert_eq!(runs.iter().filter(|x| x["group"] == "main").count(), 8);
    assert!(r["target"].is_number());
    let csv = std::fs::read_to_string(dir.join("results.csv")).unwrap();
    assert_eq!(csv.lines().count(), runs.len() + 1);
    let report = std::fs::read_to_string(dir.join("report.md")).unwrap();
    assert!(report.contains("| algorithm |") && report.contains("bench paper"));
    if report.contains("![") {
        for f in [
            "metric_vs_time",
            "metric_vs_samples",
            "throughput",
            "staleness",
            "ablations",
        ] {
            for ext in ["png", "svg"] {
                let p = dir.join(format!("{f}.{ext}"));
                assert!(
                    std::fs::metadata(&p)
                        .map(|m| m.len() > 1000)
                        .unwrap_or(false),
                    "{} missing",
                    p.display()
                );
            }
        }
    } else {
        assert!(
            report.contains("No plots:"),
            "the report must say why it has no plots"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rank_count_that_contradicts_the_launcher_is_refused() {
    let out = launch_tcp_train(2)
        .args(["--ranks", "3", "--steps", "2"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--ranks 3 contradicts the launcher"), "{err}");
}
