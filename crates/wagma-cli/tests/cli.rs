//! The `wagma` command end to end, on tiny settings so that it cannot rot.

use std::process::Command;

fn wagma() -> Command {
    Command::new(env!("CARGO_BIN_EXE_wagma"))
}

#[test]
fn bench_collectives_runs_over_mem_and_tcp() {
    for transport in ["mem", "tcp"] {
        let out = wagma()
            .args([
                "bench",
                "collectives",
                "--transport",
                transport,
                "--ranks",
                "3",
                "--elements",
                "1000",
                "--reps",
                "2",
                "--warmup",
                "1",
                "--json",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 6);
        for r in rows {
            assert!(r["median_s"].as_f64().unwrap() > 0.0);
            assert!(r["vs_memcpy"].as_f64().unwrap() > 0.0);
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
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 8);
        let ideal = v["ideal_samples_per_s"].as_f64().unwrap();
        for r in rows {
            let bound = r["bound_samples_per_s"].as_f64().unwrap();
            assert!(bound > 0.0 && bound <= ideal * (1.0 + 1e-9), "{r}");
            assert!(r["samples_per_s"].as_f64().unwrap() > 0.0);
            assert_eq!(r["measured"]["steps"].as_u64(), Some(6));
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
