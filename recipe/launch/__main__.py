from recipe.launch.plan import main

if __name__ == "__main__":
    main()
