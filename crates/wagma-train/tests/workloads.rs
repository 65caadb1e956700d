//! Each workload learns; WAGMA and allreduce-SGD agree on images; a resumed deterministic run
//! ends exactly where the uninterrupted one does; bad data and checkpoints are refused.

use std::path::{Path, PathBuf};

use wagma::algo::{AlgoConfig, Algorithm, WagmaOptions};
use wagma::imbalance::{Imbalance, Profile};
use wagma_train::checkpoint;
use wagma_train::data::text::Corpus;
use wagma_train::data::{idx, mnist1d};
use wagma_train::nav::NavConfig;
use wagma_train::trainer::{self, FINAL_MODEL, Quiet};
use wagma_train::workloads::image::ImageWorkload;
use wagma_train::workloads::navigate::{NavigateWorkload, PpoConfig};
use wagma_train::workloads::translate::{Dims, TranslateWorkload};
use wagma_train::{Execution, Summary, TrainConfig, TrainError, WorkloadKind};

fn out(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wagma-train-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn config(workload: WorkloadKind, algo: &str, ranks: usize, steps: u64, dir: &Path) -> TrainConfig {
    TrainConfig {
        workload,
        algo: AlgoConfig::new(Algorithm::from_name(algo).unwrap()),
        ranks,
        steps,
        eval_every: steps,
        out: dir.to_path_buf(),
        progress: false,
        // Learning is asserted on a fixed outcome: virtual time, seeded scheduling.
        execution: Execution::Virtual,
        ..TrainConfig::default()
    }
}

fn image(batch: usize) -> ImageWorkload {
    ImageWorkload::new(
        mnist1d::generate(4000, 1),
        mnist1d::generate(1000, 2),
        batch,
        16,
    )
}

fn train<W: wagma_train::workloads::Workload>(w: &W, c: &TrainConfig) -> Summary {
    let s = trainer::run(w, c, "test".into(), &Quiet).unwrap();
    println!(
        "{} {}: {:?} in {:.1} s",
        s.workload, s.label, s.final_metrics, s.wall_s
    );
    s
}

#[test]
fn image_learns_and_wagma_matches_allreduce_sgd() {
    let w = image(32);
    let dir = out("image");
    let wagma = train(&w, &config(WorkloadKind::Image, "wagma", 4, 250, &dir));
    let ar = train(
        &w,
        &config(WorkloadKind::Image, "allreduce-sgd", 4, 250, &dir),
    );
    let (a, b) = (
        wagma.final_metrics["accuracy"],
        ar.final_metrics["accuracy"],
    );
    // Chance is 0.10; a nearest-class-mean classifier reaches about 0.5.
    assert!(a > 0.75, "WAGMA reached {a}");
    assert!(b > 0.75, "allreduce-sgd reached {b}");
    assert!((a - b).abs() < 0.06, "WAGMA {a} vs allreduce-sgd {b}");
    assert!(dir.join("metrics.jsonl").is_file() && dir.join("summary.json").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn more_ranks_than_training_samples_are_refused() {
    let w = ImageWorkload::new(mnist1d::generate(3, 1), mnist1d::generate(10, 2), 4, 8);
    let dir = out("too-many-ranks");
    match trainer::run(
        &w,
        &config(WorkloadKind::Image, "wagma", 4, 2, &dir),
        "test".into(),
        &Quiet,
    ) {
        Err(TrainError::Config(m)) => assert!(m.contains("at most 3 ranks"), "{m}"),
        other => panic!("4 ranks on 3 samples: {:?}", other.map(|s| s.final_metrics)),
    }
    assert!(!dir.exists(), "nothing is written");
}

/// A toy language pair with a known translation: number words.
fn toy_corpus() -> Corpus {
    let en = [
        "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    ];
    let de = [
        "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn",
    ];
    let mut pairs = Vec::new();
    for a in 0..10 {
        for b in 0..10 {
            for c in 0..4 {
                let n = 1 + (a + b + c) % 4;
                let idx: Vec<usize> = (0..n).map(|k| (a * 7 + b * 3 + c + k * 5) % 10).collect();
                let s: Vec<&str> = idx.iter().map(|&i| en[i]).collect();
                let t: Vec<&str> = idx.iter().map(|&i| de[i]).collect();
                pairs.push((format!("{} .", s.join(" ")), format!("{} .", t.join(" "))));
            }
        }
    }
    Corpus::build(&pairs, 8, 40, 100, 3)
}

#[test]
fn translation_learns_a_toy_language_pair() {
    let dims = Dims {
        d_model: 32,
        d_ff: 64,
        heads: 2,
        layers: 1,
    };
    let w = TranslateWorkload::new(toy_corpus(), 16, dims, 40);
    let dir = out("translate");
    let s = train(&w, &config(WorkloadKind::Translate, "wagma", 4, 400, &dir));
    let (bleu, acc) = (s.final_metrics["bleu"], s.final_metrics["token_accuracy"]);
    assert!(acc > 0.8, "token accuracy {acc}");
    assert!(bleu > 50.0, "BLEU {bleu}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_translation_state_that_drew_more_batches_than_steps_is_refused() {
    use wagma_train::workloads::Workload;
    let w = TranslateWorkload::new(toy_corpus(), 16, Dims::default(), 40);
    let mut local = w.local(0, 2, 7);
    assert!(
        w.load_local(&mut local, &serde_json::json!({"drawn": 5}), 5)
            .is_ok()
    );
    let endless = w.load_local(&mut local, &serde_json::json!({"drawn": u64::MAX}), 5);
    assert!(endless.is_err_and(|e| e.contains("batches drawn")));
}

#[test]
fn translation_reads_the_machines_catalogs() {
    let dir = Path::new(wagma_train::data::gettext::GERMAN_DIR);
    if !dir.is_dir() {
        println!("no German gettext catalogs on this machine; nothing to check");
        return;
    }
    let w = TranslateWorkload::from_catalogs(None, 32, 1).unwrap();
    assert!(w.train_len() > 10_000, "{}", w.describe());
}

#[test]
fn navigation_learns() {
    let w = NavigateWorkload::new(NavConfig::default(), PpoConfig::default(), 64);
    let dir = out("navigate");
    let s = train(&w, &config(WorkloadKind::Navigate, "wagma", 4, 2000, &dir));
    let spl = s.final_metrics["spl"];
    // A random walk has an SPL near 0.05 on these maps.
    assert!(spl > 0.4, "SPL {spl}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn model(dir: &Path) -> Vec<u32> {
    let s = checkpoint::read_model(&dir.join(FINAL_MODEL)).unwrap();
    s.params
        .iter()
        .chain(&s.buffers)
        .map(|x| x.to_bits())
        .collect()
}

#[test]
fn a_resumed_deterministic_run_ends_with_the_uninterrupted_model() {
    let w = image(16);
    let mut c = config(WorkloadKind::Image, "wagma", 8, 40, &out("resume-a"));
    c.execution = Execution::Virtual;
    c.imbalance = Some(Imbalance {
        profile: Profile::PaperResnet,
        time_scale: 0.01,
        seed: 4,
    });
    c.algo = AlgoConfig::new(Algorithm::Wagma(WagmaOptions {
        tau: Some(5),
        ..WagmaOptions::default()
    }));
    c.checkpoint_every = Some(15);
    let a = train(&w, &c);
    assert!(
        a.staleness.max().unwrap_or(0) > 0,
        "some rank should have been late"
    );
    let mut r = c.clone();
    r.out = out("resume-b");
    r.resume = Some(c.out.join("checkpoints"));
    let b = train(&w, &r);
    // The checkpoint at 15 rounds up to 15 (a multiple of tau); 30 is kept as the latest.
    assert_eq!(model(&c.out), model(&r.out));
    // Its waiting is the resumed part's, and so is the time it is a share of: about the
    // uninterrupted run's share (0.134 against 0.144), not a quarter of it.
    assert!(
        (0.5..1.5).contains(&(b.wait_fraction / a.wait_fraction)),
        "{} against {}",
        b.wait_fraction,
        a.wait_fraction
    );
    // Time and its no-wait ideal both count from step 0.
    assert_eq!(b.ideal_s, a.ideal_s);
    assert!(
        b.ideal_s.is_some_and(|i| i <= b.wall_s),
        "{:?} {}",
        b.ideal_s,
        b.wall_s
    );
    for d in [&c.out, &r.out] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn a_time_budget_stops_the_run_without_making_its_ranks_wait_for_each_other() {
    // Ranks that never communicate while training (local SGD averaging less often than the
    // run is long) and whose compute times differ: any wait is the budget's.
    let w = image(16);
    let mut c = config(WorkloadKind::Image, "local-sgd", 4, 40, &out("budget"));
    c.algo = AlgoConfig::new(Algorithm::LocalSgd { period: 1000 });
    c.eval_every = 10;
    c.imbalance = Some(Imbalance {
        profile: Profile::PaperResnet,
        time_scale: 0.01,
        seed: 4,
    });
    let mut twenty = c.clone();
    twenty.steps = 20;
    twenty.out = out("budget-none");
    let whole = train(&w, &twenty);
    // Spent by the first evaluation: the ranks learn it at the second and stop there, as
    // the run of 20 steps without a budget does, and at the same time.
    c.budget = Some(1e-6);
    let s = train(&w, &c);
    assert_eq!(s.steps, 20);
    assert_eq!(
        s.wall_s, whole.wall_s,
        "the ranks waited for the budget's vote"
    );
    assert_eq!(s.wait_fraction, whole.wait_fraction);
    for d in [&c.out, &twenty.out] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn bad_data_and_checkpoints_are_refused() {
    // A directory that holds something else.
    let junk = out("junk");
    std::fs::create_dir_all(&junk).unwrap();
    std::fs::write(junk.join("train-images-idx3-ubyte"), b"definitely not idx").unwrap();
    std::fs::write(junk.join("train-labels-idx1-ubyte"), b"nor this").unwrap();
    let e = idx::load_dir(&junk).unwrap_err().to_string();
    assert!(e.contains("train-images") && e.contains("IDX"), "{e}");
    assert!(idx::load_dir(&junk.join("missing")).is_err());

    // A checkpoint of another model (a wider network) and a corrupt one.
    let small = image(8);
    let mut c = config(WorkloadKind::Image, "allreduce-sgd", 2, 4, &out("ckpt"));
    c.checkpoint_every = Some(2);
    c.execution = Execution::Virtual;
    train(&small, &c);
    let wide = ImageWorkload::new(mnist1d::generate(200, 1), mnist1d::generate(50, 2), 8, 24);
    let mut r = c.clone();
    r.out = out("ckpt-r");
    r.resume = Some(c.out.join("checkpoints"));
    let e = trainer::run(&wide, &r, "test".into(), &Quiet).unwrap_err();
    assert!(
        matches!(e, TrainError::Checkpoint { .. }) && e.to_string().contains("another model"),
        "{e}"
    );
    let ck = checkpoint::locate(&c.out.join("checkpoints")).unwrap();
    let f = ck.join("rank-1.bin");
    let mut bytes = std::fs::read(&f).unwrap();
    let n = bytes.len();
    bytes.truncate(n - 9);
    std::fs::write(&f, bytes).unwrap();
    let e = trainer::run(&small, &r, "test".into(), &Quiet).unwrap_err();
    assert!(e.to_string().contains("corrupt"), "{e}");

    // An output directory that cannot be written.
    let mut bad = config(
        WorkloadKind::Image,
        "wagma",
        2,
        2,
        Path::new("/proc/wagma-cannot-write-here"),
    );
    bad.execution = Execution::Virtual;
    assert!(matches!(
        trainer::run(&small, &bad, "test".into(), &Quiet),
        Err(TrainError::Io { .. })
    ));
    for d in [&junk, &c.out, &r.out] {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Debian's `dataset-fashion-mnist`, which `Dataset::Auto` prefers. Where it is not installed
/// there is nothing to check, unless `WAGMA_REQUIRE_FASHION_MNIST` is set (CI installs it).
#[test]
fn fashion_mnist_loads_when_installed() {
    let dir = Path::new(idx::FASHION_MNIST_DIR);
    if !dir.is_dir() {
        assert!(
            std::env::var_os("WAGMA_REQUIRE_FASHION_MNIST").is_none(),
            "{} is required but missing",
            dir.display()
        );
        eprintln!("{} is not installed: nothing to check", dir.display());
        return;
    }
    let (train, test) = idx::load_dir(dir).unwrap();
    for (set, n) in [(&train, 60_000), (&test, 10_000)] {
        assert_eq!(set.labels.len(), n);
        assert_eq!((set.channels, set.height, set.width), (1, 28, 28));
        assert_eq!(set.pixels.len(), n * 28 * 28);
        assert!(set.labels.iter().all(|&l| l < 10));
        // Balanced classes: 6,000 (or 1,000) of each.
        let per_class = (0..10u8)
            .map(|c| set.labels.iter().filter(|&&l| l == c).count())
            .collect::<Vec<_>>();
        assert_eq!(per_class, vec![n / 10; 10]);
    }
}
