fn main() {
    println!("agents");
}
